from __future__ import annotations

from settings.parse import parse_lines


class Settings:
    """Typed access to `key = value` settings."""

    def __init__(self, values: dict[str, str]) -> None:
        self._values = dict(values)

    @classmethod
    def from_text(cls, text: str) -> Settings:
        return cls(parse_lines(text.splitlines()))

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._values.get(key, default)

    def get_int(self, key: str, default: int = 0) -> int:
        raw = self._values.get(key)
        return default if raw is None else int(raw)

    def get_bool(self, key: str, default: bool = False) -> bool:
        raw = self._values.get(key)
        return default if raw is None else bool(raw)
