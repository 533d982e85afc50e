"""Parse and format human durations such as '1h30m'."""

from durations.parse import format_duration, parse_duration

__all__ = ["format_duration", "parse_duration"]
