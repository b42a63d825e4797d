"""The cycle collector of a long-running process (`runtime/collector.py`): settled, it
freezes what exists and, for a control plane, spaces collections out; each collection's
pause is observed."""

from __future__ import annotations

import gc
import weakref

from runtime import collector
from runtime.loop_metrics import LoopHistogram

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


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_an_agent_s_settle_collects_first_freezes_and_keeps_cpython_s_thresholds() -> None:
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    garbage = weakref.ref(_Node())  # unreachable already, but only a collection frees it
    kept = _Node()
    assert garbage() is not None
    collector.settle(spaced=False, collect_first=True)
    try:
        assert garbage() is None, "a garbage cycle of the boot was frozen, never to be freed"
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() > frozen_before
        # What was frozen stays out of full collections: a cycle of it made garbage now
        # outlives one (freed only by unfreezing, as `unsettle` does).
        held = weakref.ref(kept)
        del kept
        gc.collect()
        assert held() is not None
    finally:
        collector.unsettle()
    gc.collect()
    assert held() is None
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
