"""Fetch-plan layout benchmark: the trees `plan_fetch` forms, fleet by fleet.

No process, network or database: synthetic fleet snapshots go through the control plane's
own `plan_fetch`, and each engine keeps the plan it was given first, as an agent keeps its
parents for a whole pass. Two ways a fleet meets a version:

- **waited**: every engine was registered before the version was published and asks for
  its plan from one snapshot that lists them all (a fleet catching up to a new version);
- **arriving**: engines register one at a time after the publication, each asking from a
  snapshot of the engines before it (a fleet that starts from nothing, or grows); with
  `--finish-after K`, each engine also applies the version K registrations later, so the
  late ones see earlier ones as holders; a fourth case has them finish so and also ask
  for their plans out of order, each up to `--asks-within` registrations after its own
  (seeded at random; a real fleet's plan requests come in another order than its
  registrations, from snapshots that list engines registered after the asker).

Per case: the most children any parent is named by in one lane (every child of a parent
shares its upload), the most for an engine that already held the version, store roots
per lane (engines with no peer, which read the store), engines interior in two lanes
(they upload twice what they download) and the deepest chain. Run: `tether bench
plan-layout` or `python -m bench.plan_layout`. The last line printed is one JSON object
with the worst figures of each way and the per-case table.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import replace
from typing import Any

import typer

from controlplane.fetch_plan import plan_fetch
from controlplane.snapshot import EngineView, FleetSnapshot, RunView
from wire import Precision, SyncState, TargetPolicy

VERSION = 2


def _view(engine_id: str, run: str, applied: int, registered: float) -> EngineView:
    return EngineView(
        engine_id=engine_id, run_id=run, url=f"http://127.0.0.1:9/{engine_id}",
        precision=Precision.BF16, capacity=1, applied_version=applied,
        sync_state=SyncState.READY, in_flight=0, staging_target=None, staging_progress=0.0,
        staging_started_at=None, lease_expires_at=time.time() + 3600, registered_at=registered,
    )  # fmt: skip


def _plans(
    fleet: dict[str, EngineView], run: str, published: float, asking: list[str], fanout: int
) -> dict[str, list[list[str]]]:
    snapshot = FleetSnapshot.build(
        time.time(), fleet.values(), [RunView(run, VERSION, published, TargetPolicy())], {}
    )
    plans = {
        me: plan_fetch(snapshot, me, run, VERSION, fanout=fanout, plan_size=3) for me in asking
    }
    return {
        me: [[p.engine_id for p in lane] for lane in plan.lanes or []] for me, plan in plans.items()
    }


def layout(
    engines: int,
    holders: int,
    fanout: int,
    arriving: bool,
    finish_after: int | None = None,
    asks_within: int = 0,
) -> dict[str, Any]:
    """The figures of one fleet (see the module docstring)."""
    run = f"layout-{uuid.uuid4().hex[:8]}"  # publication times are remembered per run
    published = time.time()
    fleet = {f"holder-{i}": _view(f"holder-{i}", run, VERSION, 0.0) for i in range(holders)}
    ids = [f"engine-{k:05d}" for k in range(engines)]
    kept: dict[str, list[list[str]]] = {}
    if arriving:
        # Engine k asks after up to `asks_within` more engines registered (seeded).
        lags = random.Random(engines * 31 + holders).choices(range(asks_within + 1), k=engines)
        asking: dict[int, list[str]] = {}
        for k in range(engines + asks_within):
            if k < engines:
                me = ids[k]
                fleet[me] = _view(me, run, VERSION - 1, published + 1 + k)
                asking.setdefault(k + lags[k], []).append(me)
            if finish_after is not None and engines > k >= finish_after:
                done = ids[k - finish_after]
                fleet[done] = replace(fleet[done], applied_version=VERSION)
            if k in asking:
                kept.update(_plans(fleet, run, published, asking.pop(k), fanout))
    else:
        fleet.update((me, _view(me, run, VERSION - 1, 0.0)) for me in ids)
        kept = _plans(fleet, run, published, ids, fanout)
    children: list[dict[str, int]] = [{} for _ in range(fanout)]
    for plan in kept.values():
        for lane, peers in enumerate(plan):
            if peers:
                children[lane][peers[0]] = children[lane].get(peers[0], 0) + 1

    def depth(me: str, lane: int) -> int:
        steps = 0
        while me in kept and kept[me][lane] and steps <= engines:
            me, steps = kept[me][lane][0], steps + 1
        return steps

    interior: dict[str, int] = {}
    for per_lane in children:
        for parent in per_lane:
            interior[parent] = interior.get(parent, 0) + 1
    return {
        "engines": engines,
        "holders": holders,
        "fanout": fanout,
        "arriving": arriving,
        "finish_after": finish_after,
        "asks_within": asks_within,
        "max_children": max((max(c.values(), default=0) for c in children), default=0),
        "max_holder_children": max(
            (n for c in children for e, n in c.items() if e.startswith("holder")), default=0
        ),
        "store_roots": [sum(1 for p in kept.values() if not p[lane]) for lane in range(fanout)],
        "interior_in_two_lanes": sum(
            1 for e, n in interior.items() if n > 1 and not e.startswith("holder")
        ),
        "depth": max((depth(me, lane) for me in ids for lane in range(fanout)), default=0),
    }


def run(
    engines: list[int] = typer.Option(
        [30, 200, 1000], help="fleet sizes (repeat the option for several)"
    ),
    holders: list[int] = typer.Option(
        [0, 1, 4], help="engines that hold the version already (repeat for several)"
    ),
    fanout: int = typer.Option(2, min=1, help="children per peer in the fetch tree (lanes)"),
    finish_after: int = typer.Option(
        20, min=1, help="arriving engines apply the version this many registrations later"
    ),
    asks_within: int = typer.Option(
        5, min=0, help="out-of-order arrivals ask up to this many registrations late"
    ),
) -> None:
    """Fetch-plan trees for fleets that waited and fleets that arrive one engine at a time."""
    cases = []
    print(
        f"{'way':<22} {'engines':>7} {'holders':>7} {'max kids':>8} {'holder kids':>11} "
        f"{'store roots':>12} {'2-lane':>6} {'depth':>5}"
    )
    for n in engines:
        for h in holders:
            for way, arriving, finish, late in (
                ("waited", False, None, 0),
                ("arriving", True, None, 0),
                (f"arriving, finish +{finish_after}", True, finish_after, 0),
                (f"arriving, asks <= +{asks_within}", True, finish_after, asks_within),
            ):
                case = layout(n, h, fanout, arriving, finish, late)
                cases.append(case)
                print(
                    f"{way:<22} {n:>7} {h:>7} {case['max_children']:>8} "
                    f"{case['max_holder_children']:>11} {case['store_roots']!s:>12} "
                    f"{case['interior_in_two_lanes']:>6} {case['depth']:>5}",
                    flush=True,
                )

    def worst(arriving: bool) -> dict[str, int]:
        mine = [c for c in cases if c["arriving"] is arriving]
        return {
            "max_children": max(c["max_children"] for c in mine),
            "max_store_roots_per_lane": max(max(c["store_roots"]) for c in mine),
            "max_interior_in_two_lanes": max(c["interior_in_two_lanes"] for c in mine),
        }

    print(json.dumps({"fanout": fanout, "waited": worst(False), "arriving": worst(True),
                      "cases": cases}))  # fmt: skip


if __name__ == "__main__":
    typer.run(run)
