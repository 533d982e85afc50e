import pytest

import semver


def test_compare_equal():
    assert semver.compare("1.2.3", "1.2.3") == 0


def test_compare_patch_order():
    assert semver.compare("1.2.3", "1.2.4") == -1
    assert semver.compare("2.0.0", "1.9.9") == 1


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        semver.parse("1.2")
    with pytest.raises(ValueError):
        semver.parse("1.x.3")


def test_max_version_single_digits():
    assert semver.max_version(["0.1.0", "0.3.0", "0.2.9"]) == "0.3.0"
