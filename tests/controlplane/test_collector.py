"""A serving control plane freezes what it started with and collects cycles rarely, and it
exports how long each collection held it (`controlplane/collector.py`)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from controlplane import collector
from controlplane.metrics import LoopHistogram
from tests.controlplane.conftest import Api

SETTLED = (collector.YOUNG, collector.MIDDLE, collector.FULL)


def test_settle_freezes_what_exists_and_the_last_unsettle_restores_the_defaults() -> None:
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    assert before != SETTLED  # nothing else in this process has settled
    kept = [object(), {"a": [1]}]  # tracked objects that exist when it settles
    collector.settle()
    try:
        assert gc.get_threshold() == SETTLED
        assert gc.get_freeze_count() >= frozen_before + len(kept)
        collector.settle()  # a second app of the same process
        collector.unsettle()  # ...stops: the first still serves
        assert gc.get_threshold() == SETTLED
    finally:
        collector.unsettle()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen_before


def test_each_collection_s_pause_is_observed_until_the_observer_is_removed() -> None:
    pauses = LoopHistogram("pauses", "test", buckets=(0.001, 1.0))
    observer = collector.PauseObserver(pauses.observe)
    observer.install()
    observer.install()  # once only
    try:
        gc.collect()
    finally:
        observer.remove()
    seen = sum(pauses.counts)
    assert seen >= 1 and pauses.sum > 0
    assert observer not in gc.callbacks
    gc.collect()
    assert sum(pauses.counts) == seen


def _gc_pauses(api: Api) -> float:
    for family in text_string_to_metric_families(api.client.get("/metrics").text):
        if family.name == "tether_gc_pause_seconds":
            return next(s.value for s in family.samples if s.name.endswith("_count"))
    raise AssertionError("tether_gc_pause_seconds is not exported")


def test_a_serving_control_plane_is_settled_and_exports_its_collections(api: Api) -> None:
    assert gc.get_threshold() == SETTLED
    before = _gc_pauses(api)
    gc.collect()
    assert _gc_pauses(api) >= before + 1


def test_gc_settle_off_leaves_cpython_s_collector_as_it_was(
    make_api: Callable[..., Any], sqlite_url: str
) -> None:
    before = gc.get_threshold()
    make_api(sqlite_url, gc_settle=False)
    assert gc.get_threshold() == before != SETTLED
