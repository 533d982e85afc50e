"""Read `key = value` settings files."""

from settings.store import Settings

__all__ = ["Settings"]
