"""Fetch plans: the control plane arranges the engines catching up to a version into a tree
over the peers that hold it, so the store serves each file about once per version."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from controlplane.fetch_plan import Suspects, plan_fetch
from controlplane.snapshot import EngineView, FleetSnapshot, RunView
from store.checksum import tensor_checksum
from store.layout import CLAIM_FILENAME
from store.manifest import INDEX_FILENAME
from tests.controlplane.conftest import Api
from tests.controlplane.test_dashboard import view
from wire import SyncState, TargetPolicy
from wire.peers import PeerReport

RUN = "run-a"


def engine(engine_id: str, applied: int | None, state: SyncState = SyncState.READY) -> EngineView:
    return view(engine_id, applied, state, run_id=RUN, lease_expires_at=time.time() + 60)


def snapshot(engines: list[EngineView], latest: int) -> FleetSnapshot:
    run = RunView(RUN, latest, time.time(), TargetPolicy())
    return FleetSnapshot.build(time.time(), engines, [run], {})


def plans(snap: FleetSnapshot, version: int, fanout: int = 2, size: int = 3) -> dict[str, list]:
    return {
        e: [p.engine_id for p in plan_fetch(
            snap, e, RUN, version, fanout=fanout, plan_size=size
        ).peers]
        for e in snap.engines
        if (snap.engines[e].applied_version or -1) < version
    }  # fmt: skip


def test_a_single_engine_fetches_from_the_store_only() -> None:
    snap = snapshot([engine("e0", 1)], latest=2)
    assert plans(snap, 2) == {"e0": []}


def test_engines_catching_up_together_form_a_tree_with_one_root_on_the_store() -> None:
    ids = [f"e{i:02d}" for i in range(15)]
    snap = snapshot([engine(e, 1) for e in ids], latest=2)
    found = plans(snap, 2, fanout=2, size=3)
    roots = [e for e, peers in found.items() if not peers]
    assert roots == ["e00"]  # the store serves each file once
    for child, peers in found.items():
        # Every peer named has a smaller id: no two engines ever wait on each other.
        assert all(p < child for p in peers)
    children: dict[str, int] = {}
    for peers in found.values():
        if peers:
            children[peers[0]] = children.get(peers[0], 0) + 1
    assert max(children.values()) <= 2  # the fan-out bounds each peer's uploads
    assert found["e14"] == ["e06", "e02", "e00"]  # nearest ancestor first


def test_engines_that_hold_the_version_come_before_those_still_fetching_it() -> None:
    snap = snapshot([engine("z-holder", 2), engine("a", 1), engine("b", 1)], latest=2)
    found = plans(snap, 2, fanout=1)
    assert found["a"] == ["z-holder"]
    assert found["b"] == ["a", "z-holder"]


def test_engines_out_of_service_or_reported_are_never_named() -> None:
    snap = snapshot([engine("a", 2, SyncState.ERROR), engine("b", 2), engine("c", 1)], latest=2)
    suspects = Suspects(suspect_s=60)
    suspects.report("c", PeerReport(peer_url=snap.engines["b"].url, reason="digest"))
    plan = plan_fetch(snap, "c", RUN, 2, fanout=2, plan_size=3, suspects=suspects.current())
    assert plan.peers == []
    assert suspects.current(now=time.monotonic() + 61) == frozenset()


def test_a_plan_size_of_zero_turns_peer_fetch_off() -> None:
    snap = snapshot([engine("a", 2), engine("b", 1)], latest=2)
    assert plan_fetch(snap, "b", RUN, 2, fanout=2, plan_size=0).peers == []


def write_claim(store_root: Path, run_id: str, version: int) -> tuple[str, str]:
    """A claim beside the index `publish` laid out (as the store writes one); both texts."""
    folder = store_root / run_id / "updates" / f"weight_v{version:06d}"
    index = (folder / INDEX_FILENAME).read_bytes()
    claim = json.dumps({INDEX_FILENAME: [len(index), tensor_checksum(index)]}, sort_keys=True)
    (folder / CLAIM_FILENAME).write_text(claim)
    return claim, index.decode()


def test_a_plan_naming_peers_carries_the_claim_and_index_read_from_the_store_once(
    make_api: Callable[..., Api], db_url: str
) -> None:
    api = make_api(db_url)
    api.create_run("relay")
    api.publish("relay", 1)
    claim, index = write_claim(api.store_root, "relay", 1)
    holder = api.register("relay", 1)
    fetcher = api.register("relay", None, sync_state="syncing")
    api.settle()

    def plan() -> dict:
        path = f"/v1/engines/{fetcher}/fetch-plan?version=1&planning=true"
        reply = api.call("GET", path, "engine")
        assert reply.status_code == 200, reply.text
        return reply.json()

    # An agent that does not ask (an older one) gets the plan it knows, without them.
    older = api.call("GET", f"/v1/engines/{fetcher}/fetch-plan?version=1", "engine").json()
    assert older["peers"] and older["planning"] is None
    first = plan()
    assert [p["engine_id"] for p in first["peers"]] == [holder]
    assert first["planning"] == {"claim": claim, "index": index}
    # Read once: with the store's copies gone the plan still carries them.
    folder = api.store_root / "relay" / "updates" / "weight_v000001"
    (folder / CLAIM_FILENAME).unlink()
    assert plan()["planning"] == {"claim": claim, "index": index}
    metrics = api.call("GET", "/metrics").text
    read = [line for line in metrics.splitlines()
            if line.startswith('tether_store_read_bytes_total{what="planning"}')]  # fmt: skip
    assert read and float(read[0].rsplit(" ", 1)[1]) == len(claim) + len(index.encode())


def test_a_plan_without_peers_or_for_an_unpublished_version_carries_no_planning_files(
    make_api: Callable[..., Api], db_url: str
) -> None:
    api = make_api(db_url)
    api.create_run("lone")
    api.publish("lone", 1)
    write_claim(api.store_root, "lone", 1)
    alone = api.register("lone", None, sync_state="syncing")
    api.settle()
    reply = api.call("GET", f"/v1/engines/{alone}/fetch-plan?version=1&planning=true", "engine")
    reply = reply.json()
    assert reply["peers"] == [] and reply["planning"] is None
    api.register("lone", 1)
    api.settle()
    ahead = api.call("GET", f"/v1/engines/{alone}/fetch-plan?version=2&planning=1", "engine")
    ahead = ahead.json()
    assert ahead["planning"] is None
