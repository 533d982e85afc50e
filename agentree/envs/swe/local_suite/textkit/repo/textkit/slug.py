import re
import unicodedata


def slugify(text: str, sep: str = "-") -> str:
    """Lower-case ASCII slug of `text`, words joined by `sep`."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]", sep, text.lower())
