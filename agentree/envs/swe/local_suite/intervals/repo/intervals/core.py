Interval = tuple[int, int]


def merge(intervals: list[Interval]) -> list[Interval]:
    """Merge overlapping or touching closed intervals.

    Returns non-overlapping intervals in ascending order of start.
    """
    out: list[Interval] = []
    for start, end in intervals:
        if start > end:
            raise ValueError(f"bad interval ({start}, {end})")
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total_length(intervals: list[Interval]) -> int:
    """Length of the union of the intervals."""
    return sum(end - start for start, end in merge(intervals))
