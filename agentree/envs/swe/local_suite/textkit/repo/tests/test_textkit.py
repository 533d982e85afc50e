import pytest

from textkit import slugify, truncate


def test_slugify_simple():
    assert slugify("Hello") == "hello"


def test_slugify_accents():
    assert slugify("Crème brûlée") == "creme-brulee"


def test_slugify_custom_sep():
    assert slugify("a b", sep="_") == "a_b"


def test_truncate_short_text_unchanged():
    assert truncate("abc", 5) == "abc"


def test_truncate_marks_cut():
    assert truncate("abcdefgh", 6) == "abc..."


def test_truncate_rejects_tiny_width():
    with pytest.raises(ValueError):
        truncate("abcdef", 2)
