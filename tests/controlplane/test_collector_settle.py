"""A serving control plane freezes what it started with and collects cycles rarely, and it
exports how long each collection held it (`runtime/collector.py`)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from runtime import collector
from tests.controlplane.conftest import Api

SETTLED = (collector.YOUNG, collector.MIDDLE, collector.FULL)


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
