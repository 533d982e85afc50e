"""Closed integer intervals."""

from intervals.core import merge, total_length

__all__ = ["merge", "total_length"]
