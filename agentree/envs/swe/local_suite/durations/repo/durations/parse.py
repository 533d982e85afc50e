import re

UNITS = {"s": 1, "m": 3600, "h": 3600, "d": 86400}
_TOKEN = re.compile(r"(\d+)([smhd])")


def parse_duration(text: str) -> int:
    """Seconds in a duration like '2d', '1h30m' or '45s'."""
    text = text.strip().lower()
    if not text or _TOKEN.sub("", text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * UNITS[unit] for n, unit in _TOKEN.findall(text))


def format_duration(seconds: int) -> str:
    """The inverse of parse_duration, largest units first ('1h30m')."""
    if seconds < 0:
        raise ValueError("negative duration")
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"
