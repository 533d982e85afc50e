from collections import Counter


def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of empty data")
    return sum(values) / len(values)


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("median of empty data")
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def mode(values: list[float]) -> float:
    """Most common value; the smallest one on ties."""
    if not values:
        raise ValueError("mode of empty data")
    counts = Counter(values)
    top = max(counts.values())
    return min(v for v, c in counts.items() if c == top)
