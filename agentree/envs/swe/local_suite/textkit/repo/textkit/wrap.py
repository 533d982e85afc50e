def truncate(text: str, width: int, ellipsis: str = "...") -> str:
    """Shorten `text` to at most `width` characters, marking the cut with `ellipsis`."""
    if width < len(ellipsis):
        raise ValueError("width is smaller than the ellipsis")
    if len(text) <= width:
        return text
    return text[: width - len(ellipsis)] + ellipsis
