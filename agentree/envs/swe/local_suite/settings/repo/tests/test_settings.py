import pytest

from settings import Settings

TEXT = """
# service settings
name = demo
workers = 4
debug = true
"""


def test_get_string():
    assert Settings.from_text(TEXT).get("name") == "demo"


def test_get_int():
    assert Settings.from_text(TEXT).get_int("workers") == 4
    assert Settings.from_text(TEXT).get_int("missing", 7) == 7


def test_get_bool_true():
    assert Settings.from_text(TEXT).get_bool("debug") is True


def test_get_bool_default():
    assert Settings.from_text(TEXT).get_bool("missing", True) is True


def test_parse_error_names_line():
    with pytest.raises(ValueError, match="line 2"):
        Settings.from_text("a = 1\nbroken\n")
