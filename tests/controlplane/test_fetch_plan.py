"""Fetch plans: the control plane arranges the engines catching up to a version into a tree
over the peers that hold it, so the store serves each file about once per version."""

from __future__ import annotations

import itertools
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

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


def plans(
    snap: FleetSnapshot, version: int, fanout: int = 2, size: int = 3, lane: int = 0
) -> dict[str, list]:
    return {
        e: [p.engine_id for p in plan_fetch(
            snap, e, RUN, version, fanout=fanout, plan_size=size
        ).lanes[lane]]
        for e in snap.engines
        if (snap.engines[e].applied_version or -1) < version
    }  # fmt: skip


def test_a_single_engine_fetches_from_the_store_only() -> None:
    snap = snapshot([engine("e0", 1)], latest=2)
    assert plans(snap, 2) == {"e0": []}
    assert plans(snap, 2, lane=1) == {"e0": []}


def test_engines_catching_up_together_form_one_tree_per_lane_with_one_root_on_the_store() -> None:
    ids = [f"e{i:02d}" for i in range(15)]
    snap = snapshot([engine(e, 1) for e in ids], latest=2)
    for lane in range(2):
        found = plans(snap, 2, fanout=2, size=3, lane=lane)
        roots = [e for e, peers in found.items() if not peers]
        assert len(roots) == 1  # the store serves each file once
        children: dict[str, int] = {}
        for peers in found.values():
            if peers:
                children[peers[0]] = children.get(peers[0], 0) + 1
                # Nearest first: each ancestor is its predecessor's parent.
                for near, far in itertools.pairwise(peers):
                    assert found[near][0] == far
        assert max(children.values()) <= 2  # the fan-out bounds each peer's uploads
        # Every chain ends at the root within log2(15) levels.
        assert all(len(p) == 3 or (not p or p[-1] == roots[0]) for p in found.values())
    # The plan's `peers` (what an agent without lanes follows) is lane 0.
    plan = plan_fetch(snap, "e14", RUN, 2, fanout=2, plan_size=3)
    assert plan.peers == plan.lanes[0] and len(plan.lanes) == 2


@pytest.mark.parametrize("n", [30, 200, 1000])
def test_no_engine_uploads_in_two_lanes_however_the_circle_shares_them_out(n: int) -> None:
    ids = [f"engine-{i:04d}" for i in range(n)]
    snap = snapshot([engine(e, 1) for e in ids], latest=2)
    fanout = 2
    interior: dict[str, int] = dict.fromkeys(ids, 0)
    for lane in range(fanout):
        parents = {peers[0] for peers in plans(snap, 2, fanout, lane=lane).values() if peers}
        for parent in parents:
            interior[parent] += 1
    counts = list(interior.values())
    # One tree would make every interior engine serve in both "lanes". Dealing the lanes
    # round a circle left the one whose share of the circle came short by chance taking
    # the rest of its interior from the next lane's first engines, its root among them:
    # that root served twice the children and its whole lane ran at half rate.
    assert max(counts) == 1
    assert sum(counts) >= len(ids) - 2  # N/fanout interior engines per lane


@pytest.mark.parametrize(("holders", "fanout"), [(1, 2), (1, 3), (2, 3), (5, 2), (40, 3)])
def test_engines_holding_the_version_upload_in_one_lane_each(holders: int, fanout: int) -> None:
    # A fleet starting together behind the few engines that already hold the version
    # (a cold start, a restarted fleet): a holder at the top of every lane served
    # `fanout` children in each, and every lane below it ran at 1/fanout of a link.
    held = [f"holder-{i:02d}" for i in range(holders)]
    fetching = [f"engine-{i:04d}" for i in range(200)]
    snap = snapshot([engine(e, 2) for e in held] + [engine(e, 1) for e in fetching], latest=2)
    lanes_of: dict[str, set[int]] = {}
    for lane in range(fanout):
        found = plans(snap, 2, fanout, lane=lane)
        for peers in found.values():
            if peers:
                lanes_of.setdefault(peers[0], set()).add(lane)
        roots = [e for e, peers in found.items() if not peers]
        lane_holders = {p[-1] for p in found.values() if p and p[-1] in held}
        if lane < holders:  # the lane's holders head it; no fetcher reads the store
            assert roots == [] and lane_holders
        else:  # a lane with no holder of its own has one root, on the store
            assert len(roots) == 1 and not lane_holders
    assert all(len(lanes_of.get(h, ())) <= 1 for h in held)  # a holder serves one lane
    if fanout == 2:  # ... as every fetcher does (at 3 or more lanes, nearly every one)
        assert max(len(lanes) for lanes in lanes_of.values()) == 1


def test_parents_come_before_their_children_whoever_else_the_snapshot_holds() -> None:
    # Two control-plane replicas (or two moments) see different engines heading to V: the
    # union of the parent edges they hand out has no cycle in any lane, so no two engines
    # ever wait on each other for a file.
    everyone = [f"e{i:03d}" for i in range(60)]
    early = snapshot([engine(e, 1) for e in everyone[:40]], latest=2)
    late = snapshot([engine(e, 1) for e in everyone[20:]], latest=2)
    for lane in range(2):
        edges: dict[str, set[str]] = {}
        for snap in (early, late):
            for child, peers in plans(snap, 2, fanout=2, size=1, lane=lane).items():
                edges.setdefault(child, set()).update(peers)
        assert all(acyclic(edges, e, frozenset(), set()) for e in edges)


def acyclic(edges: dict[str, set[str]], node: str, path: frozenset[str], done: set[str]) -> bool:
    """No path from `node` along `edges` comes back to a node on it."""
    if node in path:
        return False
    if node in done:
        return True
    ok = all(acyclic(edges, p, path | {node}, done) for p in edges.get(node, ()))
    done.add(node)
    return ok


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


def growing_fleet(
    run: str,
    n: int,
    *,
    holders: int = 0,
    finish_after: int | None = None,
    fanout: int = 2,
    asks_within: int = 0,
) -> dict[str, list[list[str]]]:
    """Engines registering one at a time after v2 was published, each asking for its plan
    from a snapshot of those registered so far and keeping it (an agent keeps its parents
    for its whole pass); with `finish_after`, each applies v2 that many registrations later;
    with `asks_within`, each asks only after up to that many more engines registered
    (seeded at random; the asks of a real fleet come in another order than its
    registrations). Every engine's plan, per lane."""
    published = time.time()
    fleet = {
        f"holder-{i}": view(f"holder-{i}", 2, run_id=run, lease_expires_at=published + 600)
        for i in range(holders)
    }
    lags = random.Random(n).choices(range(asks_within + 1), k=n)
    asking: dict[int, list[str]] = {}
    kept: dict[str, list[list[str]]] = {}
    for k in range(n + asks_within):
        if k < n:
            me = f"engine-{k:04d}"
            registered = dict(
                run_id=run, lease_expires_at=published + 600, registered_at=published + 1 + k
            )
            fleet[me] = view(me, 1, **registered)
            asking.setdefault(k + lags[k], []).append(me)
        if finish_after is not None and n > k >= finish_after:
            done = f"engine-{k - finish_after:04d}"
            fleet[done] = replace(fleet[done], applied_version=2)
        snap = FleetSnapshot.build(
            time.time(), fleet.values(), [RunView(run, 2, published, TargetPolicy())], {}
        )
        for me in asking.pop(k, []):
            plan = plan_fetch(snap, me, run, 2, fanout=fanout, plan_size=3)
            kept[me] = [[p.engine_id for p in lane] for lane in plan.lanes]
    return kept


@pytest.mark.parametrize(
    ("n", "holders", "finish_after", "asks_within"),
    [
        (30, 0, None, 0),
        (300, 0, None, 0),
        (300, 2, None, 0),
        (300, 0, 20, 0),
        (300, 1, 20, 0),
        (30, 1, None, 3),
        (300, 0, None, 5),
        (300, 1, 20, 5),
    ],
)
def test_engines_arriving_one_at_a_time_form_balanced_trees_as_a_fleet_that_waited(
    n: int, holders: int, finish_after: int | None, asks_within: int
) -> None:
    # A cold start: engines register one by one after the version was published. Laid out
    # by place on the circle, each newcomer landed anywhere in its lane and the first
    # parents were named by 10 or more children (every lane below them at a fraction of
    # a link); a streak of newcomers placed in one lane all hung under one parent. Where
    # a leaf hung depended on how many engines had registered when it asked (a parent of
    # four in a 30-engine bench run).
    run = f"growing-{n}-{holders}-{finish_after}-{asks_within}"
    kept = growing_fleet(
        run, n, holders=holders, finish_after=finish_after, asks_within=asks_within
    )
    fanout = 2
    lanes_of: dict[str, set[int]] = {}
    for lane in range(fanout):
        children: dict[str, int] = {}
        edges: dict[str, set[str]] = {}
        for me, plan in kept.items():
            if plan[lane]:
                children[plan[lane][0]] = children.get(plan[lane][0], 0) + 1
                lanes_of.setdefault(plan[lane][0], set()).add(lane)
                edges[me] = {plan[lane][0]}
        # `fanout` children in the parent's own tree, `fanout - 1` from the other lanes
        assert max(children.values()) <= 2 * fanout - 1
        roots = [me for me, plan in kept.items() if not plan[lane]]
        assert len(roots) <= (0 if holders > lane else 2)  # the store serves a file twice at most
        # Plans asked at different moments still point only at engines that came first.
        assert all(acyclic(edges, e, frozenset(), set()) for e in edges)
    fetchers = [e for e, lanes in lanes_of.items() if not e.startswith("holder")]
    assert all(len(lanes_of[e]) == 1 for e in fetchers)  # each uploads in one lane only


def test_a_replica_that_never_saw_the_version_as_the_newest_lays_everyone_out_by_place() -> None:
    # The publication time is learnt from the snapshots built while the version is the
    # newest; a replica that started later cannot tell late engines from early ones and places them
    # all by their place on the circle, as for a fleet that waited.
    published = time.time()
    run_id = f"unseen-{uuid.uuid4().hex}"  # the publication times are kept per process
    late = [
        view(f"engine-{k:02d}", 1, run_id=run_id, lease_expires_at=published + 600,
             registered_at=published + 1 + k)
        for k in range(30)
    ]  # fmt: skip
    early = [replace(e, registered_at=0.0) for e in late]

    def layout(engines: list[EngineView], latest: int) -> dict[str, list[list[str]]]:
        run = RunView(run_id, latest, published, TargetPolicy())
        snap = FleetSnapshot.build(time.time(), engines, [run], {})
        return {
            e.engine_id: [
                [p.engine_id for p in lane]
                for lane in plan_fetch(snap, e.engine_id, run_id, 2, fanout=2, plan_size=3).lanes
            ]
            for e in engines
        }

    assert layout(late, latest=3) == layout(early, latest=3)
    # Any snapshot built while v2 was the newest teaches it, with no plan asked then (a
    # replica whose agents asked another one for their plans meanwhile).
    FleetSnapshot.build(time.time(), late, [RunView(run_id, 2, published, TargetPolicy())], {})
    assert layout(late, latest=3) != layout(early, latest=3)
    assert layout(late, latest=3) == layout(late, latest=2)


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
    assert older["peers"] and "planning" not in older and "lanes" not in older
    laned = api.call("GET", f"/v1/engines/{fetcher}/fetch-plan?version=1&lanes=true", "engine")
    assert laned.json()["lanes"][0] == older["peers"] and len(laned.json()["lanes"]) == 2
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
    assert reply["peers"] == [] and reply.get("planning") is None
    api.register("lone", 1)
    api.settle()
    ahead = api.call("GET", f"/v1/engines/{alone}/fetch-plan?version=2&planning=1", "engine")
    ahead = ahead.json()
    assert ahead.get("planning") is None


def test_a_new_engine_is_planned_from_a_snapshot_listing_it_and_those_registered_before_it(
    make_api: Callable[..., Api], sqlite_url: str
) -> None:
    """A new engine asks for its plan right after it registers, before the read its
    registration asked for is installed. Laid out from a snapshot that lists neither it nor
    the engine registered just before it, it took that engine's rank and lane."""
    from wire.engines import EngineRegister

    # No periodic read: only the reads a change asks for.
    api = make_api(sqlite_url, snapshot_refresh_s=600.0)
    run_id = f"late-{uuid.uuid4().hex[:8]}"  # publication times are remembered per run
    api.create_run(run_id)
    api.publish(run_id, 1)
    holder = api.register(run_id, 1)
    api.settle()
    cp = api.client.app.state.cp

    def registered_elsewhere(name: str) -> str:
        """Registered in the database without telling this replica (as by another one)."""
        body = EngineRegister(
            url=f"http://127.0.0.1:9/{name}", run_id=run_id, precision="bf16",
            sync_state=SyncState.SYNCING,
        )  # fmt: skip
        return cp.registry.register(body, None)[0]

    first, second = registered_elsewhere("first"), registered_elsewhere("second")
    assert first not in cp.fleet.snapshot.engines and second not in cp.fleet.snapshot.engines
    reply = api.call("GET", f"/v1/engines/{second}/fetch-plan?version=1&lanes=true", "engine")
    assert reply.status_code == 200, reply.text
    lanes = [[peer["engine_id"] for peer in lane] for lane in reply.json()["lanes"]]
    # By registration the holder ranks first (lane 0), `first` second (lane 1's root) and
    # `second` third: under the holder in its own lane, a leaf under `first` in lane 1.
    # Laid out without the two, `second` ranked second and read lane 1 from the store too.
    assert lanes == [[holder], [first]]
    assert first in cp.fleet.snapshot.engines


def test_waiting_for_a_snapshot_that_lists_an_engine_ends_at_its_limit(
    make_api: Callable[..., Api], sqlite_url: str
) -> None:
    api = make_api(sqlite_url)
    fleet = api.client.app.state.cp.fleet
    # No read ever lists an engine that never registered: the current snapshot comes back.
    found = api.client.portal.call(fleet.listing, "never-registered", 0.2)
    assert "never-registered" not in found.engines
    assert found.read_at > 0


def test_a_plan_carries_the_claims_and_indexes_of_the_versions_since_the_engines_own(
    make_api: Callable[..., Api], sqlite_url: str
) -> None:
    api = make_api(sqlite_url)
    api.create_run("chain")
    written = {}
    for version in (1, 2, 3):
        api.publish("chain", version)
        written[version] = write_claim(api.store_root, "chain", version)
    api.register("chain", 3)
    behind = api.register("chain", 0, sync_state="syncing")
    api.settle()

    def plan(query: str) -> dict:
        path = f"/v1/engines/{behind}/fetch-plan?version=3&planning=true{query}"
        reply = api.call("GET", path, "engine")
        assert reply.status_code == 200, reply.text
        return reply.json()

    earlier = plan("&since=0")["earlier"]
    assert [e["version"] for e in earlier] == [1, 2]
    assert [(e["claim"], e["index"]) for e in earlier] == [written[1], written[2]]
    assert [e["version"] for e in plan("&since=1")["earlier"]] == [2]
    # Nothing between, or not asked (an older agent): no such field.
    assert "earlier" not in plan("&since=2")
    assert "earlier" not in plan("")
    assert plan("&since=0")["planning"] == {"claim": written[3][0], "index": written[3][1]}
    bad = api.call("GET", f"/v1/engines/{behind}/fetch-plan?version=3&since=-1", "engine")
    assert bad.status_code == 422 and "since" in bad.text


def test_a_plan_carries_no_more_claim_and_index_bytes_than_its_limit(
    make_api: Callable[..., Api], sqlite_url: str
) -> None:
    """A model of ~100k tensors has an index of megabytes: relayed to a whole fleet through
    the control plane, several versions at a time, it would be gigabytes from one process.
    A plan carries the version's own, then earlier ones oldest first, while they fit; a
    version whose own do not fit is not relayed at all (the engines read the store)."""
    first = make_api(sqlite_url)
    first.create_run("big")
    sizes = {}
    for version in (1, 2, 3):
        first.publish("big", version)
        sizes[version] = sum(len(text) for text in write_claim(first.store_root, "big", version))
    first.register("big", 3)
    behind = first.register("big", 0, sync_state="syncing")

    def plan(limit: int) -> dict:
        """The plan from a replica (same database and store) relaying at most `limit`."""
        api = make_api(sqlite_url, planning_relay_max_bytes=limit)
        api.settle()
        path = f"/v1/engines/{behind}/fetch-plan?version=3&planning=true&since=0"
        reply = api.call("GET", path, "engine")
        assert reply.status_code == 200, reply.text
        return reply.json()

    everything = sizes[1] + sizes[2] + sizes[3]
    assert [e["version"] for e in plan(everything)["earlier"]] == [1, 2]
    short = plan(everything - 1)
    assert [e["version"] for e in short["earlier"]] == [1]
    assert "planning" in short
    own_only = plan(sizes[3] + sizes[1] - 1)
    assert "planning" in own_only and "earlier" not in own_only
    assert "planning" not in plan(sizes[3] - 1)


def test_an_earlier_versions_trees_can_rank_two_engines_the_other_way_round() -> None:
    """Engines registered before v1 was published are laid out by place in both versions'
    trees; one registered between v1 and v2 is a late leaf in v1's and placed by place in
    v2's. So in some lane an early engine can be the ancestor of a middle one for v1 and
    its descendant for v2: fetching v1's file of that lane, the early engine heading for
    v2 (by v2's plan) and the middle one heading for v1 (by v1's) each waited on the
    other. Fetched by v1's own trees (`version_lanes`), no two engines wait on each other."""
    run = f"between-{uuid.uuid4().hex[:8]}"
    t0 = time.time()

    def joined(name: str, registered_at: float) -> EngineView:
        return view(name, 0, run_id=run, lease_expires_at=t0 + 600, registered_at=registered_at)

    early = [joined(f"early-{i:02d}", t0 - 10 - i) for i in range(10)]
    middle = [joined(f"middle-{i:02d}", t0 + 10 + i) for i in range(10)]
    FleetSnapshot.build(t0, early, [RunView(run, 1, t0, TargetPolicy())], {})  # v1 published
    snap = FleetSnapshot.build(
        t0 + 200, early + middle, [RunView(run, 2, t0 + 100, TargetPolicy())], {}
    )

    def ancestors(engine_id: str, version: int) -> list[set[str]]:
        plan = plan_fetch(snap, engine_id, run, version, fanout=2, plan_size=3)
        return [{p.engine_id for p in lane} for lane in plan.lanes or []]

    crossed = [
        (e.engine_id, m.engine_id, lane)
        for e in early
        for m in middle
        for lane in range(2)
        if m.engine_id in ancestors(e.engine_id, 2)[lane]
        and e.engine_id in ancestors(m.engine_id, 1)[lane]
    ]
    assert crossed, "the layouts of v1 and v2 agree here: the case is not exercised"
    everyone = [e.engine_id for e in early + middle]
    for lane in range(2):
        for a, b in itertools.combinations(everyone, 2):
            assert not (a in ancestors(b, 1)[lane] and b in ancestors(a, 1)[lane])


def test_a_plan_asked_with_since_carries_each_earlier_versions_own_lanes(
    make_api: Callable[..., Api], sqlite_url: str
) -> None:
    api = make_api(sqlite_url)
    api.create_run("laned")
    for version in (1, 2, 3):
        api.publish("laned", version)
    api.register("laned", 3)
    behind = [api.register("laned", 0, sync_state="syncing") for _ in range(4)]
    api.settle()

    def plan(version: int, query: str = "") -> dict:
        path = f"/v1/engines/{behind[-1]}/fetch-plan?version={version}&lanes=true{query}"
        reply = api.call("GET", path, "engine")
        assert reply.status_code == 200, reply.text
        return reply.json()

    found = plan(3, "&since=0&version_lanes=true")["version_lanes"]
    assert [each["version"] for each in found] == [1, 2]
    assert [each["lanes"] for each in found] == [plan(1)["lanes"], plan(2)["lanes"]]
    # Not asked for (an older agent), or no version between: no such field.
    assert "version_lanes" not in plan(3, "&since=0")
    assert "version_lanes" not in plan(3, "&since=2&version_lanes=true")
