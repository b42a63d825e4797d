"""What keeps the control plane's event loop and heartbeats responsive at fleet scale: the
heartbeat writer never queues behind other routes' work in the shared thread pool, a beat
is answered before its commit where the snapshot shows its engine leased to the sender, a
snapshot swap wakes the waiting target long-polls only when an answer could change (and
nothing else wakes a parked one), and this process's heartbeats are patched into the
snapshot rather than read back whole."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from controlplane.db import migrate, open_engine, session_factory
from controlplane.errors import EngineNotOwned, EngineUnknown
from controlplane.fleet import Fleet
from controlplane.heartbeats import GroupCommit, Heartbeats
from controlplane.long_poll import long_poll
from controlplane.metrics import Metrics
from controlplane.registry import Registry
from controlplane.router import eligible
from controlplane.runs import Runs
from controlplane.snapshot import FleetSnapshot
from store.types import VersionConstraint
from wire import EngineRegister, Heartbeat, RunCreate, SyncState

DEADLINE_S = 30.0


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Registry, Runs]]:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    migrate(url)
    engine = open_engine(url)
    sessions = session_factory(engine)
    runs = Runs(sessions, str(tmp_path))
    runs.create(RunCreate(run_id="r"))
    registry = Registry(sessions, lease_seconds=60.0)
    yield registry, runs
    registry.close()
    engine.dispose()


def register(registry: Registry, host: int = 1, owner: str | None = None) -> str:
    body = EngineRegister(
        url=f"http://10.0.0.{host}:8000",
        run_id="r",
        precision="bf16",
        applied_version=0,
        sync_state="ready",
    )
    return registry.register(body, owner)[0]


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll `check` on the event loop until it holds; fail naming `what` at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened"
        await asyncio.sleep(0.01)


def test_a_heartbeat_is_committed_while_every_thread_of_the_shared_pool_is_busy(
    stores: tuple[Registry, Runs],
) -> None:
    registry, _ = stores
    engine_id = register(registry)
    beat = Heartbeat.model_validate({"applied_version": 0, "sync_state": "ready"})

    async def scenario() -> float | None:
        loop = asyncio.get_running_loop()
        shared = ThreadPoolExecutor(2)
        loop.set_default_executor(shared)
        release = threading.Event()
        # Both threads of the shared pool held, as by slow lookups of other routes.
        held = [asyncio.to_thread(release.wait, DEADLINE_S) for _ in range(2)]
        busy = asyncio.gather(*held)
        writer = GroupCommit(
            lambda beats: registry.heartbeat_many(
                [(e, b) for e, b, _ in beats], [o for *_, o in beats]
            )
        )
        await writer.start()
        try:
            return await asyncio.wait_for(writer.submit((engine_id, beat, None)), DEADLINE_S)
        finally:
            release.set()
            await busy
            await writer.stop()

    expires = asyncio.run(scenario())

    assert expires is not None and expires > time.time() + 30


def test_a_snapshot_swap_wakes_target_long_polls_only_when_an_answer_can_change(
    stores: tuple[Registry, Runs],
) -> None:
    registry, runs = stores
    register(registry)

    async def scenario() -> None:
        fleet = Fleet(registry, runs, Metrics(), refresh_s=3600.0)
        await fleet.start()
        try:
            base = fleet.snapshot
            assert len(base.engines) == 1
            waiter = asyncio.ensure_future(fleet.wait_changed(DEADLINE_S))
            for _ in range(5):  # let it start waiting
                await asyncio.sleep(0)

            # In-flight counts and staging progress move on every beat; targets do not.
            busier = [
                replace(e, in_flight=e.in_flight + 3, staging_progress=0.5)
                for e in base.engines.values()
            ]
            fleet.install(FleetSnapshot.build(time.time(), busier, base.runs.values(), {}))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiter.done(), "a swap that changes no target woke the long-polls"

            published = [replace(r, latest_version=1) for r in base.runs.values()]
            fleet.install(FleetSnapshot.build(time.time(), busier, published, {}))
            await asyncio.wait_for(waiter, DEADLINE_S)
            assert set(fleet.snapshot.targets.values()) == {1}
        finally:
            await fleet.stop()

    asyncio.run(scenario())


def snapshots(metrics: Metrics, how: str) -> float:
    found = metrics.registry.get_sample_value("tether_fleet_snapshots_total", {"how": how})
    return found or 0.0


def test_a_parked_long_poll_waits_its_whole_timeout_in_one_wait_until_woken() -> None:
    # No timer round per waiting poll: the shutdown wakes them (`draining.on_begin`); a
    # poll that woke every 0.25 s cost 4,000 wake-ups a second at 1,000 engines.
    checks: list[float] = []
    waits: list[float] = []

    async def check() -> str | None:
        checks.append(time.monotonic())
        return "changed" if len(checks) == 2 else None

    async def wait(left: float) -> None:
        waits.append(left)

    assert asyncio.run(long_poll(check, wait, 30.0)) == "changed"
    assert len(waits) == 1 and 29.0 < waits[0] <= 30.0, waits


def test_a_burst_of_state_changing_heartbeats_is_patched_in_without_reading_the_fleet_back(
    stores: tuple[Registry, Runs],
) -> None:
    registry, runs = stores
    engine_ids = [register(registry, host) for host in range(1, 4)]
    last = 8

    async def scenario() -> None:
        metrics = Metrics()
        fleet = Fleet(registry, runs, metrics, refresh_s=3600.0)
        heartbeats = Heartbeats(registry, runs, fleet, fleet.outage)
        await fleet.start()
        await heartbeats.writer.start()
        try:
            assert snapshots(metrics, "read") == 1  # the start's
            # A rollout's burst: each engine stages every version, then serves it.
            for version in range(1, last + 1):
                for state, applied, staging in (
                    ("syncing", version - 1, version),
                    ("ready", version, None),
                ):
                    beat = Heartbeat.model_validate(
                        {
                            "applied_version": applied,
                            "sync_state": state,
                            "staging_target": staging,
                            "in_flight": version,
                        }
                    )
                    await asyncio.gather(*(heartbeats.answer(e, beat) for e in engine_ids))
            await until(
                lambda: {e.applied_version for e in fleet.snapshot.engines.values()} == {last},
                "the beats reaching the snapshot",
            )

            # 48 state changes, and the database was read only at the start.
            assert snapshots(metrics, "read") == 1
            assert 1 <= snapshots(metrics, "patch") <= 2 * last * len(engine_ids)
            # The patched snapshot routes and answers as a read of the database would.
            snap = fleet.snapshot
            read = fleet.load()
            assert snap.engines == read.engines
            assert snap.targets == read.targets
            routable = eligible(snap, "r", VersionConstraint(min_version=last), now=time.time())
            assert sorted(e.engine_id for e in routable) == sorted(engine_ids)

            # A registration is not a heartbeat: it reads the rows written since, at once.
            newcomer = register(registry, 9)
            fleet.mark_dirty()
            await until(
                lambda: newcomer in fleet.snapshot.engines, "the registration reaching the snapshot"
            )
            assert snapshots(metrics, "read") == 1
            assert snapshots(metrics, "changed") == 1
            assert fleet.snapshot.engines == (await asyncio.to_thread(fleet.load)).engines
            # Another replica's announcement may be a deleted row: every row is read.
            fleet.mark_dirty(whole=True)
            await until(lambda: snapshots(metrics, "read") == 2, "a read of every row")
        finally:
            await heartbeats.writer.stop()
            await fleet.stop()

    asyncio.run(scenario())


def test_leased_since_returns_only_the_engines_written_at_or_after_that_time(
    stores: tuple[Registry, Runs],
) -> None:
    registry, _ = stores
    quiet = register(registry, 1)
    beaten = register(registry, 2)
    written = time.time()
    # Strictly after `written`, whatever the clock's resolution.
    while time.time() <= written:
        pass
    registry.heartbeat(
        beaten, Heartbeat.model_validate({"applied_version": 0, "sync_state": "ready"})
    )
    newcomer = register(registry, 3)

    assert {e.engine_id for e in registry.leased()} == {quiet, beaten, newcomer}
    assert {e.engine_id for e in registry.leased(since=written)} == {beaten, newcomer}
    assert registry.leased(since=time.time() + 60) == []


def test_periodic_reads_merge_the_rows_written_since_and_a_whole_read_drops_what_they_cannot_see(
    stores: tuple[Registry, Runs],
) -> None:
    registry, runs = stores
    engine_ids = [register(registry, host) for host in range(1, 5)]
    # Another replica's writes: straight to the database, nothing noted in this process.
    other_replica_beat = Heartbeat.model_validate(
        {"applied_version": 0, "sync_state": "syncing", "staging_target": 1, "in_flight": 7}
    )

    async def scenario() -> None:
        metrics = Metrics()
        fleet = Fleet(registry, runs, metrics, refresh_s=0.05, full_read_s=3600.0)
        await fleet.start()
        try:
            assert snapshots(metrics, "read") == 1  # the start's
            await asyncio.to_thread(registry.heartbeat, engine_ids[0], other_replica_beat)
            await until(
                lambda: fleet.snapshot.engines[engine_ids[0]].in_flight == 7,
                "a read of the other replica's beat",
            )
            assert snapshots(metrics, "changed") >= 1
            assert snapshots(metrics, "read") == 1
            # The merged snapshot is what a read of every row gives.
            whole = await asyncio.to_thread(fleet.load)
            assert fleet.snapshot.engines == whole.engines
            assert fleet.snapshot.targets == whole.targets
            assert set(fleet.snapshot.engines) == set(engine_ids)

            # A deregistration another replica did not announce is not a written row: the
            # reads of changed rows keep the engine until a read of every row.
            await asyncio.to_thread(registry.deregister, engine_ids[1])
            changed = snapshots(metrics, "changed")
            await until(
                lambda: snapshots(metrics, "changed") >= changed + 2, "two reads of changed rows"
            )
            assert engine_ids[1] in fleet.snapshot.engines
            fleet.full_read_s = 0.05
            await until(lambda: engine_ids[1] not in fleet.snapshot.engines, "a read of every row")
            assert snapshots(metrics, "read") >= 2
        finally:
            await fleet.stop()

    asyncio.run(scenario())


def test_a_deregistration_in_this_process_is_read_whole_at_once(
    stores: tuple[Registry, Runs],
) -> None:
    registry, runs = stores
    engine_ids = [register(registry, host) for host in range(1, 4)]

    async def scenario() -> None:
        metrics = Metrics()
        fleet = Fleet(registry, runs, metrics, refresh_s=0.05, full_read_s=3600.0)
        await fleet.start()
        try:
            await asyncio.to_thread(registry.deregister, engine_ids[0])
            fleet.note_departed(engine_ids[0])
            await until(
                lambda: engine_ids[0] not in fleet.snapshot.engines,
                "the deregistration leaving the snapshot",
            )
            assert snapshots(metrics, "read") >= 2
        finally:
            await fleet.stop()

    asyncio.run(scenario())


def counted(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_a_beat_of_an_engine_the_snapshot_shows_leased_to_its_sender_is_answered_first(
    stores: tuple[Registry, Runs], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, runs = stores
    owner = "a" * 64
    departed, owned = (register(registry, host, owner) for host in (1, 2))
    # Each batch's write waits for a token: the test decides when a commit happens.
    tokens: queue.Queue[None] = queue.Queue()
    renew = registry.heartbeat_many

    def gated(*args: object, **kwargs: object) -> list[float | None]:
        tokens.get(timeout=DEADLINE_S)
        return renew(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(registry, "heartbeat_many", gated)
    ready = Heartbeat.model_validate({"applied_version": 0, "sync_state": "ready"})
    syncing = Heartbeat.model_validate(
        {"applied_version": 0, "sync_state": "syncing", "staging_target": 1}
    )
    metrics = Metrics()
    fleet = Fleet(registry, runs, metrics, refresh_s=3600.0)
    heartbeats = Heartbeats(registry, runs, fleet, fleet.outage, metrics)

    def answered_first() -> float:
        return counted(metrics, "tether_heartbeats_answered_first_total")

    async def committed(beat: asyncio.Future[bytes]) -> bytes:
        """The answer of a beat that waits for its commit: one batch, one token."""
        tokens.put(None)
        return await asyncio.wait_for(beat, DEADLINE_S)

    async def scenario() -> None:
        await fleet.start()
        await heartbeats.writer.start()
        try:
            answer = await asyncio.wait_for(heartbeats.answer(owned, syncing, owner), DEADLINE_S)
            assert orjson.loads(answer)["lease_expires_at"] > time.time() + 50
            assert answered_first() == 1
            # Not committed yet, so neither the database nor the snapshot shows it...
            assert registry.rows(owned)[0].sync_state == SyncState.READY.value
            assert fleet.snapshot.engines[owned].sync_state == SyncState.READY
            # ...and a listing waits for its commit, so it reads the beat back.
            flushed = asyncio.ensure_future(heartbeats.writer.flushed())
            await asyncio.sleep(0)
            assert not flushed.done()
            tokens.put(None)
            await asyncio.wait_for(flushed, DEADLINE_S)
            assert registry.rows(owned)[0].sync_state == SyncState.SYNCING.value
            await until(
                lambda: fleet.snapshot.engines[owned].sync_state == SyncState.SYNCING,
                "the answered beat's commit reaching the snapshot",
            )
            assert counted(metrics, "tether_heartbeat_commit_seconds_count") == 1

            # Another token's beat waits for its commit, which refuses it.
            stranger = asyncio.ensure_future(heartbeats.answer(owned, ready, "b" * 64))
            with pytest.raises(EngineNotOwned):
                await committed(stranger)
            assert answered_first() == 1

            # Deleted behind the snapshot's back (as through another replica): answered
            # first once; its commit refuses it, and its next beat waits and gets the 404.
            registry.deregister(departed)
            await asyncio.wait_for(heartbeats.answer(departed, ready, owner), DEADLINE_S)
            assert answered_first() == 2
            reads = snapshots(metrics, "changed")
            tokens.put(None)
            await until(
                lambda: snapshots(metrics, "changed") > reads,
                "the refused commit making the snapshot read the database",
            )
            with pytest.raises(EngineUnknown):
                await committed(asyncio.ensure_future(heartbeats.answer(departed, ready, owner)))
            assert answered_first() == 2

            # In a database outage every beat waits for its commit.
            fleet.outage.failed(RuntimeError("database away"), "the test")
            await committed(asyncio.ensure_future(heartbeats.answer(owned, ready, owner)))
            assert answered_first() == 2
        finally:
            for _ in range(8):
                tokens.put(None)
            await heartbeats.writer.stop()
            await fleet.stop()

    asyncio.run(scenario())
