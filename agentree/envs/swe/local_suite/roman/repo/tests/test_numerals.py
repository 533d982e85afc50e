import pytest

from roman import from_roman, to_roman


def test_to_roman_additive():
    assert to_roman(3) == "III"
    assert to_roman(8) == "VIII"
    assert to_roman(2023) == "MMXXIII"


def test_to_roman_range():
    with pytest.raises(ValueError):
        to_roman(0)


def test_from_roman():
    assert from_roman("XIV") == 14
    assert from_roman("MCMXCIV") == 1994
