import pytest

from durations import format_duration, parse_duration


def test_parse_seconds():
    assert parse_duration("45s") == 45


def test_parse_hours_and_days():
    assert parse_duration("2h") == 7200
    assert parse_duration("1d2h") == 93600


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_duration("10 minutes")
    with pytest.raises(ValueError):
        parse_duration("")


def test_format():
    assert format_duration(5400) == "1h30m"
    assert format_duration(0) == "0s"
