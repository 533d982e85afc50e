_SYMBOLS = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]
_VALUE = {s: v for v, s in _SYMBOLS}


def to_roman(n: int) -> str:
    """Roman numeral for 1 <= n <= 3999."""
    if not 1 <= n <= 3999:
        raise ValueError("only 1..3999 can be written in Roman numerals")
    out = []
    for value, symbol in _SYMBOLS:
        count, n = divmod(n, value)
        out.append(symbol * count)
    return "".join(out)


def from_roman(text: str) -> int:
    """Value of a Roman numeral (subtractive pairs such as IV are understood)."""
    total = 0
    for i, ch in enumerate(text):
        if ch not in _VALUE:
            raise ValueError(f"not a Roman numeral: {text!r}")
        value = _VALUE[ch]
        if i + 1 < len(text) and _VALUE.get(text[i + 1], 0) > value:
            total -= value
        else:
            total += value
    return total
