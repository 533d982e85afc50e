import pytest

from minstats import mean, median, mode


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_empty_raises():
    with pytest.raises(ValueError):
        median([])


def test_mode_ties_pick_smallest():
    assert mode([3, 1, 3, 1, 2]) == 1
