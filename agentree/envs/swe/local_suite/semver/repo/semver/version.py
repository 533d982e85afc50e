def parse(version: str) -> tuple:
    """Split 'MAJOR.MINOR.PATCH' into its three components."""
    major, minor, patch = version.strip().split(".")
    if not all(part.isdigit() for part in (major, minor, patch)):
        raise ValueError(f"not a version: {version!r}")
    return major, minor, patch


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as version `a` is lower than, equal to or higher than `b`."""
    pa, pb = parse(a), parse(b)
    return (pa > pb) - (pa < pb)


def max_version(versions: list[str]) -> str:
    """The highest of `versions`."""
    if not versions:
        raise ValueError("no versions given")
    best = versions[0]
    for v in versions[1:]:
        if compare(v, best) > 0:
            best = v
    return best
