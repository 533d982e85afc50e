"""Experiment configs shipped as package data."""
