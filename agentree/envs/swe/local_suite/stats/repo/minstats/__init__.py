"""Tiny descriptive statistics."""

from minstats.central import mean, median, mode

__all__ = ["mean", "median", "mode"]
