"""Eligibility, affinity, leases, target policies and the retryable 409."""

from __future__ import annotations

import random
import time

from controlplane.policy import PolicyEngine, assign_targets
from controlplane.router import pick
from controlplane.snapshot import EngineView, FleetSnapshot, RunView
from launcher.processes import wait_until
from store.types import VersionConstraint
from tests.controlplane.conftest import Api
from wire import PolicyKind, Precision, SyncState, TargetPolicy


def _engine(engine_id: str, version: int | None, **kw: object) -> EngineView:
    values: dict[str, object] = {
        "engine_id": engine_id,
        "run_id": "r",
        "url": f"http://127.0.0.1:9/{engine_id}",
        "precision": Precision.BF16,
        "capacity": 1,
        "applied_version": version,
        "sync_state": SyncState.READY,
        "in_flight": 0,
        "staging_target": None,
        "staging_progress": 0.0,
        "staging_started_at": None,
        "lease_expires_at": time.time() + 60,
    }
    values.update(kw)
    return EngineView(**values)  # type: ignore[arg-type]


def _snapshot(engines: list[EngineView], latest: int = 9) -> FleetSnapshot:
    return FleetSnapshot.build(
        time.time(), engines, [RunView("r", latest, None, TargetPolicy())], {}
    )


def test_only_engines_that_satisfy_the_constraint_precision_and_state_are_picked() -> None:
    engines = [
        _engine("old", 3),
        _engine("new", 7),
        _engine("fp8", 7, precision=Precision.FP8),
        _engine("booting", 9, sync_state=SyncState.BOOTING),
        _engine("draining", 9, sync_state=SyncState.DRAINING),
        _engine("syncing", 5, sync_state=SyncState.SYNCING),
        _engine("lapsed", 9, lease_expires_at=time.time() - 1),
        _engine("other-run", 9, run_id="other"),
    ]
    snap = _snapshot(engines)
    now = time.time()
    rng = random.Random(0)

    def picked(constraint: VersionConstraint, **kw: object) -> set[str]:
        found = {pick(snap, "r", constraint, now=now, rng=rng, **kw) for _ in range(200)}
        return {e.engine_id for e in found if e is not None}

    assert picked(VersionConstraint(min_version=6)) == {"new", "fp8"}
    assert picked(VersionConstraint(min_version=6), precisions={Precision.BF16}) == {"new"}
    assert picked(VersionConstraint(exact_version=5)) == {"syncing"}
    assert picked(VersionConstraint(exact_version=9)) == set()
    assert picked(VersionConstraint()) == {"old", "new", "fp8", "syncing"}
    assert picked(VersionConstraint(min_version=1), exclude={"old", "new", "fp8"}) == {"syncing"}


def test_least_loaded_of_two_choices_avoids_a_busy_engine() -> None:
    snap = _snapshot([_engine("busy", 5, in_flight=50), _engine("idle", 5)])
    now = time.time()
    chosen = [pick(snap, "r", VersionConstraint(), now=now).engine_id for _ in range(50)]
    assert set(chosen) == {"idle"}


def test_session_affinity_survives_an_unrelated_engine_leaving() -> None:
    engines = [_engine(f"e{i}", 5) for i in range(12)]
    snap = _snapshot(engines)
    now = time.time()
    sessions = [f"session-{i}" for i in range(300)]
    before = {s: pick(snap, "r", VersionConstraint(), session_id=s, now=now) for s in sessions}
    assert len({e.engine_id for e in before.values()}) > 6, "sessions spread over engines"

    leaving = "e3"
    after_snap = _snapshot([e for e in engines if e.engine_id != leaving])
    for session, engine in before.items():
        again = pick(after_snap, "r", VersionConstraint(), session_id=session, now=now)
        if engine.engine_id != leaving:
            assert again.engine_id == engine.engine_id, session
        else:
            assert again.engine_id != leaving


def test_keep_pinned_keeps_k_engines_on_a_pinned_version_and_the_rest_follow_latest() -> None:
    policy = TargetPolicy(kind=PolicyKind.KEEP_PINNED, engines=2, window_s=30, max_lag=4)
    engines = [PolicyEngine(f"e{i}", 5 if i < 3 else 6, True) for i in range(6)]
    now = 1000.0
    targets = assign_targets(policy, 8, engines, {5: now - 1}, now)
    pinned = [e for e, v in targets.items() if v == 5]
    assert len(pinned) == 2
    assert set(pinned) <= {"e0", "e1", "e2"}, "engines already on v are preferred"
    assert all(v == 8 for e, v in targets.items() if e not in pinned)
    # Stale demand, or a version too far behind, releases the pin.
    assert set(assign_targets(policy, 8, engines, {5: now - 31}, now).values()) == {8}
    assert set(assign_targets(policy, 10, engines, {5: now}, now).values()) == {10}
    # follow_latest ignores demand.
    assert set(assign_targets(TargetPolicy(), 8, engines, {5: now}, now).values()) == {8}


def test_lapsed_lease_takes_an_engine_out_of_routing(make_api, sqlite_url: str) -> None:
    api: Api = make_api(sqlite_url, lease_seconds=1.0)
    api.create_run("lease")
    api.publish("lease", 1)
    engine_id = api.register("lease", 1)
    api.settle()
    routed = api.call("GET", "/v1/route?run_id=lease&min_version=1", "client")
    assert routed.json()["engine_id"] == engine_id

    def out_of_routing() -> bool:
        reply = api.call("GET", "/v1/route?run_id=lease&min_version=1", "client")
        return reply.status_code == 409

    wait_until(out_of_routing, 10.0, "the lapsed engine to leave routing")
    assert api.heartbeat(engine_id, 1).status_code == 404, "the agent must register again"


def test_no_eligible_engine_is_a_retryable_409_with_the_fleet_picture(api: Api) -> None:
    api.create_run("nr")
    api.publish("nr", 3)
    api.publish("nr", 4)
    on_three = api.register("nr", 3)
    staging = api.register("nr", 3)
    api.heartbeat(staging, 3, sync_state="syncing", staging_target=4, staging_progress=0.0)
    api.settle()
    reply = api.call(
        "POST", "/v1/generate", "client", json={"text": "x", "weight_version": {"min_version": 4}}
    )
    assert reply.status_code == 409
    error = reply.json()["error"]
    assert error["type"] == "WeightVersionNotReady"
    assert error["retryable"] is True
    assert error["requested"] == {"min_version": 4, "exact_version": None}
    assert error["latest_version"] == 4
    assert error["fleet_versions"] == {on_three: 3, staging: 3}
    assert int(reply.headers["Retry-After"]) >= 1
    metrics = api.client.get("/metrics").text
    assert 'tether_router_409_total{reason="none_eligible"}' in metrics


def test_keep_pinned_through_the_api_pins_engines_while_exact_requests_arrive(api: Api) -> None:
    api.create_run("pin")
    policy = {"kind": "keep_pinned", "engines": 2, "window_s": 1.0, "max_lag": 8}
    assert api.call("PUT", "/v1/runs/pin/policy", "trainer", json=policy).status_code == 200
    api.publish("pin", 2)
    engines = [api.register("pin", 2) for _ in range(4)]
    api.publish("pin", 3)
    api.settle()
    # Exact requests for v2 arrive: two engines must stay on v2, the others move to v3.
    assert api.call("GET", "/v1/route?run_id=pin&exact_version=2", "client").status_code == 200

    def targets() -> dict[str, int]:
        listed = api.call("GET", "/v1/engines?run_id=pin", "client").json()["engines"]
        # An engine the snapshot has not seen yet has no target (-1 here) for a moment.
        return {e["engine_id"]: e["target_version"] or -1 for e in listed}

    def pinned_two() -> bool:
        api.call("GET", "/v1/route?run_id=pin&exact_version=2", "client")
        found = targets()
        return sorted(found.values()) == [2, 2, 3, 3] and set(found) == set(engines)

    wait_until(pinned_two, 10.0, "two engines pinned to v2")
    # Demand stops: after the window every engine follows latest again.
    wait_until(lambda: sorted(targets().values()) == [3, 3, 3, 3], 10.0, "the pin to lapse")


def test_a_patched_snapshot_replaces_only_listed_engines_and_leaves_out_lapsed_leases() -> None:
    read = FleetSnapshot.build(
        100.0,
        [_engine("a", 1, lease_expires_at=110.0), _engine("b", 1, lease_expires_at=110.0)],
        [RunView("r", 2, 100.0, TargetPolicy())],
        {},
    )

    patched = read.patched(
        120.0,
        [_engine("a", 2, lease_expires_at=130.0), _engine("stranger", 2, lease_expires_at=130.0)],
    )

    assert set(patched.engines) == {"a"}  # b's lease lapsed at 110; a patch adds no engine
    assert patched.engines["a"].applied_version == 2
    assert patched.groups[("r", Precision.BF16)].versions == [2]
    assert patched.targets == {"a": 2}
    assert (patched.read_at, patched.built_at) == (100.0, 120.0)
