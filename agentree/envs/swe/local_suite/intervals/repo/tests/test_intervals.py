import pytest

from intervals import merge, total_length


def test_merge_sorted_overlapping():
    assert merge([(1, 3), (2, 6), (8, 10)]) == [(1, 6), (8, 10)]


def test_merge_touching():
    assert merge([(1, 2), (2, 5)]) == [(1, 5)]


def test_merge_empty():
    assert merge([]) == []


def test_merge_rejects_reversed():
    with pytest.raises(ValueError):
        merge([(3, 1)])


def test_total_length_sorted():
    assert total_length([(0, 2), (1, 4)]) == 4
