def parse_lines(lines: list[str]) -> dict[str, str]:
    """Parse `key = value` lines; blank lines and `#` comments are ignored."""
    values: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"line {number}: expected 'key = value'")
        values[key.strip()] = value.strip()
    return values
