"""The in-process view of the fleet: the current snapshot and what keeps it fresh.

Owns the snapshot swap, the refresher task (reload from the shared database every
`snapshot_refresh_s`, sooner after this process changed something), this process's
in-flight counts, and the buffer of exact-version demand it writes back for `keep_pinned`.
Everything here can be rebuilt from the database within a second: no replica keeps
anything essential only in memory.

A heartbeat this process committed that changes its engine's state does not reload the
database: the refresher patches the engine's row into the current snapshot
(`FleetSnapshot.patched`). During a rollout such beats come several times a second, and a
reload reads every leased engine's row (~16 us of CPU per engine, 70 % of a rebuild, at
1,000 engines), while the beat already holds all the row would change. Registrations,
deregistrations, publications, policy changes and demand still reload at once, and a reload
still comes every `snapshot_refresh_s` (the other replicas' writes).

That periodic reload reads only the rows written since shortly before the previous read
(`Registry.leased(since=...)`: a heartbeat or registration sets `heartbeat_at`) and merges
them into the snapshot; at 1,000 engines beating every 10 s that is ~150 rows instead of
1,000, twice a second. So does the read right after a registration, publication, policy
change or new demand in this process: each is a written row or a table read whole every
time, and a publication's wake-up of the fleet's target long-polls waits for this read (one
of every row costs ~15 ms more at 1,000 engines). Every row is read at start, after a
deregistration in this process, after anything another replica announced, after a database
outage, and at least every `full_read_s`: what a read of changed rows cannot see (a row
deleted without an announcement, a write whose timestamp is more than `CHANGED_OVERLAP_S`
behind its commit or behind this clock) is in the snapshot within that time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from controlplane.catalog import Catalog
from controlplane.errors import EngineUnknown
from controlplane.metrics import Metrics
from controlplane.outage import Outage, is_database_down
from controlplane.registry import Registry
from controlplane.runs import Runs
from controlplane.snapshot import EngineView, FleetSnapshot, RunView
from wire import Heartbeat, PolicyKind

log = logging.getLogger(__name__)

DEMAND_HORIZON_S = 86_400.0
REAP_GRACE_S = 300.0
# A read of changed rows starts this long before the previous read did: a heartbeat's
# `heartbeat_at` is taken before its commit, and by another replica's clock.
CHANGED_OVERLAP_S = 1.0


class Fleet:
    def __init__(
        self,
        registry: Registry,
        runs: Runs,
        metrics: Metrics,
        refresh_s: float,
        catalog: Catalog | None = None,
        outage: Outage | None = None,
        full_read_s: float = 10.0,
    ) -> None:
        self.registry = registry
        self.outage = outage or Outage(registry, 1.0, 60.0)
        self.runs = runs
        self.catalog = catalog
        self.metrics = metrics
        self.refresh_s = refresh_s
        self.full_read_s = full_read_s
        self.snapshot = FleetSnapshot.empty()
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        metrics.watch_in_flight(self.in_flight)
        self._pending_demand: dict[tuple[str, int], float] = {}
        self._dirty: asyncio.Event | None = None
        # Set with `_dirty` when the next refresh must read the database (not only patch):
        # the rows written since the last read, or (`_reread`) every row.
        self._read = False
        self._reread = False
        # Heartbeats committed here since the snapshot's read, in commit order, to patch in.
        self._beats: list[tuple[str, Heartbeat, float]] = []
        self._last_read = 0.0  # time.monotonic() when the last read was installed
        self._last_full_read = -math.inf  # ... and the last read of every row
        # Where the next read of changed rows starts (time.time()); None: read every row.
        self._changed_since: float | None = None
        # Engines deregistered here since the snapshot's read (appended from route threads).
        self._departed: list[str] = []
        self._changed: asyncio.Event | None = None
        # Set (and replaced) at every snapshot swap: `listing` waits on it for a new read.
        self._installed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_reap = 0.0
        self._stopping = False
        # Called with each new snapshot on the event loop (the dashboard's trackers); they
        # must be cheap and never raise into the refresher.
        self.observers: list[Callable[[FleetSnapshot], None]] = []

    # -------------------------------------------------------------- refresh

    def load(self, whole: bool = True) -> FleetSnapshot:
        """Read the database and build a new snapshot (blocking; call off the loop). Not
        `whole`: only the engine rows written since shortly before the previous read,
        merged into the current snapshot's engines (see the module's docstring)."""
        self.outage.recover()
        demand, self._pending_demand = self._pending_demand, {}
        try:
            self.registry.record_demand(demand)
        except Exception:
            # Keep the demand for the next round; the snapshot must still refresh.
            for key, at in demand.items():
                self._pending_demand[key] = max(at, self._pending_demand.get(key, 0.0))
            raise
        now = time.time()
        if now - self._last_reap > REAP_GRACE_S:
            self._last_reap = now
            self.registry.reap(REAP_GRACE_S)
        runs = self.runs.views()
        wanted = self.registry.demand(now - DEMAND_HORIZON_S)
        since = None if whole else self._changed_since
        rows = self.registry.leased(now, since)
        engines = rows if since is None else {**self.snapshot.engines, **_by_id(rows)}.values()
        snap = FleetSnapshot.build(now, engines, runs, wanted, self._held(runs, wanted))
        self._changed_since = now - CHANGED_OVERLAP_S
        return snap

    def _held(
        self, runs: list[RunView], demand: dict[str, dict[int, float]]
    ) -> dict[str, frozenset[int]]:
        """The store's versions of each run that pins old versions, so a version `store gc`
        deleted is never pinned: listed again whenever a newly demanded version is not in
        the last listing (the existence check before a pin), else every `catalog.ttl_s`."""
        if self.catalog is None:
            return {}
        held = {}
        for run in runs:
            if run.policy.kind is not PolicyKind.KEEP_PINNED:
                continue
            found = self.catalog.versions(run.run_id, run.store_url, demand.get(run.run_id, {}))
            if found is not None:
                held[run.run_id] = found
        return held

    def install(self, snap: FleetSnapshot) -> None:
        previous, self.snapshot = self.snapshot, snap
        self.outage.view_refreshed(snap.read_at)
        self.metrics.observe_fleet(snap)
        for observe in self.observers:
            try:
                observe(snap)
            except Exception:
                log.exception("a fleet observer failed on a new snapshot")
        if self._installed is not None:
            installed, self._installed = self._installed, asyncio.Event()
            installed.set()
        if _answers_may_differ(previous, snap):
            self.wake_waiters()

    async def refresh(self, whole: bool = True) -> FleetSnapshot:
        """Read the database and install the snapshot (on the event loop); not `whole`:
        only the rows written since the previous read (`load`)."""
        # Beats and deregistrations noted so far were committed before this read began.
        covered, departed = len(self._beats), len(self._departed)
        # A deregistration noted here is not in a read of changed rows: read them all.
        whole = whole or departed > 0 or self._changed_since is None
        self.install(await asyncio.to_thread(self.load, whole))
        self._last_read = time.monotonic()
        if whole:
            self._last_full_read = self._last_read
        self.metrics.fleet_snapshots.labels("read" if whole else "changed").inc()
        del self._beats[:covered]
        del self._departed[:departed]
        return self.snapshot

    def patch(self) -> None:
        """Install the snapshot with the heartbeats noted since its read patched in (on
        the event loop; no database)."""
        beats, self._beats = self._beats, []
        engines = self.snapshot.engines
        views: dict[str, EngineView] = {}
        for engine_id, beat, expires in beats:
            seen = views.get(engine_id) or engines.get(engine_id)
            if seen is not None:
                views[engine_id] = _beaten(seen, beat, expires, self.registry.lease_seconds)
        if views:
            self.install(self.snapshot.patched(time.time(), views.values()))
            self.metrics.fleet_snapshots.labels("patch").inc()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._dirty = asyncio.Event()
        self._changed = asyncio.Event()
        self._installed = asyncio.Event()
        await self.refresh()
        self._task = asyncio.create_task(self._refresher(), name="fleet-refresher")

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        # Python 3.11's wait_for can swallow one cancellation, so cancel until it ends.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)

    async def _refresher(self) -> None:
        assert self._dirty is not None
        while True:
            due = self._last_read + self.refresh_s - time.monotonic()
            if due > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), due)
            self._dirty.clear()
            try:
                now = time.monotonic()
                # An outage or its thaw: only a read of every row brings the renewed leases.
                whole = (
                    self._reread
                    or not self.outage.settled()
                    or now - self._last_full_read >= self.full_read_s
                )
                if whole or self._read or now - self._last_read >= self.refresh_s:
                    self._read = self._reread = False
                    await self.refresh(whole)
                else:
                    self.patch()
            except Exception as exc:
                self._last_read = time.monotonic()  # the next try after `refresh_s`
                if is_database_down(exc):
                    # Routing goes on from the last snapshot (see `lease_clock`).
                    self.outage.failed(exc, "fleet refresh")
                else:
                    log.exception("fleet snapshot refresh failed; keeping the previous snapshot")
            # Coalesce bursts of local writes into at most ~20 refreshes a second.
            await asyncio.sleep(0.05)

    def lease_clock(self) -> float:
        """The time routing compares leases with (frozen during a database outage)."""
        return self.outage.lease_clock()

    # -------------------------------------------------------------- signals

    def mark_dirty(self, whole: bool = False) -> None:
        """Fleet state changed: read the database soon rather than on the next tick. The
        rows written since the last read carry what this process changes (a registration
        or heartbeat sets `heartbeat_at`; runs, policies and demand are read whole every
        time; a deregistration here is noted with `note_departed`); `whole`: every row, for
        what another replica announced (its deregistrations delete rows)."""
        if self._dirty is not None:
            self._read = True
            self._reread = self._reread or whole
            self._dirty.set()

    def note_beat(self, engine_id: str, beat: Heartbeat, expires: float) -> None:
        """This process committed `beat` (lease until `expires`), which changes the state
        the snapshot shows for `engine_id`: patch it in soon (on the event loop)."""
        if self._dirty is not None:
            self._beats.append((engine_id, beat, expires))
            self._dirty.set()

    def note_departed(self, engine_id: str) -> None:
        """This process deregistered `engine_id` (committed; safe from worker threads)."""
        self._departed.append(engine_id)
        self.poke()

    async def engine_run(self, engine_id: str) -> str:
        """The run of a leased engine; `EngineUnknown` if it has no row or its lease lapsed.

        From the snapshot where it shows the engine leased now (a lease alive there is
        alive in the database too: leases only move forward), so the target long-poll and
        the fetch plan, one per engine per version, read no row; from the database for an
        engine registered since the read, or deregistered here since (one deregistered
        through another replica is seen with that replica's writes, on the next read)."""
        seen = self.leased(engine_id)
        if seen is not None:
            return seen.run_id
        rows = await asyncio.to_thread(self.registry.rows, engine_id)
        if not rows:
            raise EngineUnknown(
                f"engine {engine_id!r} is not registered or its lease lapsed: register again"
            )
        return str(rows[0].run_id)

    def leased(self, engine_id: str, until: float | None = None) -> EngineView | None:
        """The engine as the snapshot shows it if its lease there lasts past `until` (default
        now) and it was not deregistered here since the read; else None. A lease alive in
        the snapshot is alive in the database too: leases only move forward."""
        seen = self.snapshot.engines.get(engine_id)
        if (
            seen is None
            or seen.lease_expires_at <= (time.time() if until is None else until)
            or engine_id in self._departed
        ):
            return None
        return seen

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the event loop; safe from worker threads (sync routes)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(callback)

    def poke(self) -> None:
        """Thread-safe `mark_dirty`, for routes that run in the thread pool."""
        self.call_soon(self.mark_dirty)

    def wake_waiters(self) -> None:
        """Return every `wait_changed` now (on the event loop): the snapshot may answer
        differently, or the server began to shut down."""
        if self._changed is not None:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def wait_changed(self, timeout: float) -> None:
        """Return after the next snapshot swap that may change an engine's target (which
        engines are leased, their targets, a run's latest version), or after `timeout`
        seconds."""
        if self._changed is None:
            await asyncio.sleep(timeout)
            return
        # A timer, not `wait_for`'s task per waiter: every waiting long-poll comes back here
        # after each wake-up.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()

    async def listing(self, engine_id: str, wait_s: float) -> FleetSnapshot:
        """The snapshot, once it lists `engine_id`: if the current one does not (the engine
        registered after it was read), the first read that begins after this call, waited
        for at most `wait_s` seconds (then the current snapshot, whatever it lists).

        A new engine asks for its fetch plan within milliseconds of registering, before the
        read its registration asked for has been installed. A plan laid out from a snapshot
        that lists neither it nor the engines registered just before it gives it a rank
        among the late engines that one of those already holds (`fetch_plan`): in a
        30-engine cold start two engines that asked in the same millisecond got the same
        rank, and so the same lane and parents. A read that began after the request began
        after the registration was committed, and so after those of the engines registered
        before it."""
        if engine_id in self.snapshot.engines or self._installed is None:
            return self.snapshot
        asked = time.time()
        self.mark_dirty()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while self.snapshot.read_at < asked:
                    await self._installed.wait()
        return self.snapshot

    def note_exact(self, run_id: str, version: int) -> None:
        """An exact-version request arrived; keep_pinned reads this demand."""
        key = (run_id, version)
        first = key not in self._pending_demand and version not in self.snapshot.demand.get(
            run_id, {}
        )
        self._pending_demand[key] = time.time()
        if first:
            self.mark_dirty()


# A snapshot older than this is stale to the target long-poll (`app.py`), which then waits
# for a fresh one rather than answer for an engine it does not list.
STALE_AFTER_S = 5.0


def _answers_may_differ(before: FleetSnapshot, after: FleetSnapshot) -> bool:
    """Whether a target long-poll could answer differently from `after` than from `before`.

    Every heartbeat that changes an engine's state swaps the snapshot (up to ~20 times a
    second during a rollout); waking every waiting long-poll on each swap cost the event
    loop one wake-up, check and re-wait per engine per swap (at 300 engines, 6,000 a second),
    while their answers (targets) change about once per published version."""
    return (
        before.targets != after.targets
        or before.engines.keys() != after.engines.keys()
        or {r: v.latest_version for r, v in before.runs.items()}
        != {r: v.latest_version for r, v in after.runs.items()}
        or after.read_at - before.read_at >= STALE_AFTER_S
    )


def _by_id(views: list[EngineView]) -> dict[str, EngineView]:
    return {view.engine_id: view for view in views}


def _beaten(seen: EngineView, beat: Heartbeat, expires: float, lease_s: float) -> EngineView:
    """`seen` as `Registry.heartbeat_many` leaves its row after committing `beat`."""
    started: float | None
    if seen.staging_target == beat.staging_target and seen.staging_started_at is not None:
        started = seen.staging_started_at
    else:
        started = expires - lease_s if beat.staging_target is not None else None
    return replace(
        seen,
        applied_version=beat.applied_version,
        sync_state=beat.sync_state,
        staging_target=beat.staging_target,
        staging_progress=beat.staging_progress,
        staging_started_at=started,
        in_flight=beat.in_flight,
        last_error=beat.last_error,
        lease_expires_at=expires,
    )
