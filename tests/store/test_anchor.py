"""The anchor policy: FULL with no base, every K versions, or when a delta is too big."""

from __future__ import annotations

import pytest

from store.anchor import AnchorPolicy
from store.errors import InvalidVersion
from store.types import VersionKind

FULL, DELTA = VersionKind.FULL, VersionKind.DELTA


def test_the_first_version_of_a_run_is_full():
    assert AnchorPolicy().choose(0, None, None, 100) is FULL
    assert AnchorPolicy().choose(5, None, 1, 100) is FULL


def test_a_full_anchor_comes_every_k_versions_since_the_last():
    policy = AnchorPolicy(every=3)
    kinds = []
    last = None
    for version in range(8):
        kind = policy.choose(version, last, 1, 100)
        if kind is FULL:
            last = version
        kinds.append(kind)
    assert kinds == [FULL, DELTA, DELTA, FULL, DELTA, DELTA, FULL, DELTA]


def test_a_delta_larger_than_half_the_checkpoint_becomes_full():
    policy = AnchorPolicy(every=10)
    assert policy.choose(3, 0, 50, 100) is DELTA
    assert policy.choose(3, 0, 51, 100) is FULL
    assert AnchorPolicy(max_delta_ratio=0.2).choose(3, 0, 21, 100) is FULL


def test_an_unmeasured_delta_is_judged_by_distance_only():
    assert AnchorPolicy(every=4).choose(2, 0, None, 100) is DELTA


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"max_delta_ratio": 0.0}, {"max_delta_ratio": 2}])
def test_nonsense_settings_are_refused(kwargs):
    with pytest.raises(InvalidVersion):
        AnchorPolicy(**kwargs)
