"""Parse and compare MAJOR.MINOR.PATCH versions."""

from semver.version import compare, max_version, parse

__all__ = ["compare", "max_version", "parse"]
