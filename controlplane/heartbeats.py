"""Engine heartbeats: group commit into the database, and the reply each engine gets.

Owns the single writer task of a process: heartbeats that arrive while one batch is being
written wait together and go into the next transaction (one commit for hundreds of
beats), and every waiter gets its own answer: the new lease expiry or `EngineUnknown`.
At low load a batch is a single beat, so nothing waits for a timer. The writer has a
thread of its own: in the shared pool a batch queued behind every other route's database
reads (at 300 engines a target long-poll's lookup each, and the snapshot's rebuilds), which
put most of a heartbeat's time in the control plane into that queue. Also owns the reply
(target version from the snapshot, the lease) and the "fleet changed" signal a heartbeat
raises, and hands the fetch report a heartbeat carries to its observers. Never routes and
never decides targets.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import orjson

from controlplane.background import BackgroundTask
from controlplane.errors import ApiError, EngineUnknown
from controlplane.fleet import Fleet
from controlplane.metrics import Metrics
from controlplane.outage import DATABASE_ERRORS, Outage, is_database_down
from controlplane.registry import Registry
from controlplane.runs import Runs
from controlplane.snapshot import EngineView
from wire import FetchReport, Heartbeat

log = logging.getLogger(__name__)

# (engine id, the report, the sender's token hash; None for an admin token)
Beat = tuple[str, Heartbeat, str | None]
# SQLite and PostgreSQL both take a few hundred short UPDATEs in one transaction easily.
MAX_BATCH = 500
# A beat is answered before its commit only if the snapshot shows its lease alive this
# much longer: ample for the batches ahead of it to be written.
ANSWER_FIRST_MARGIN_S = 5.0


class GroupCommit:
    """Batches `submit`ted beats into calls of `write`, run in the writer's own thread
    (between `start` and `stop`; before, or after, in the shared pool)."""

    def __init__(
        self,
        write: Callable[[Sequence[Beat]], list[float | None]],
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._write = write
        self._max_batch = max_batch
        self._pending: list[tuple[Beat, asyncio.Future[float | None]]] = []
        self._wake: asyncio.Event | None = None
        self._task = BackgroundTask("heartbeat-writer", self._writer)
        self._thread: ThreadPoolExecutor | None = None
        # The waiter of the beat queued last: batches are written in order (`flushed`).
        self._last: asyncio.Future[float | None] | None = None

    @property
    def running(self) -> bool:
        return self._task.running and self._wake is not None

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="heartbeat-writer")
        await self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        if self._thread is not None:
            # A batch still being written finishes in its thread; nobody waits for it.
            self._thread.shutdown(wait=False)
            self._thread = None
        pending, self._pending = self._pending, []
        for _, waiter in pending:
            if not waiter.done():
                waiter.set_exception(RuntimeError("the control plane is shutting down"))

    async def submit(self, beat: Beat) -> float | None:
        """The new lease expiry of this beat's engine, or None if it is unknown."""
        if not self.running:
            return (await asyncio.to_thread(self._write, [beat]))[0]
        return await self.enqueue(beat)

    def enqueue(self, beat: Beat) -> asyncio.Future[float | None]:
        """Queue `beat` for the next batch (the writer must be running); the future gets
        what `submit` would return, or the write's exception."""
        assert self._wake is not None, "the heartbeat writer is not running"
        waiter: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._pending.append((beat, waiter))
        self._last = waiter
        self._wake.set()
        return waiter

    async def flushed(self) -> None:
        """Return once every beat queued before this call has been written (or failed):
        a read of the database after it sees them."""
        last = self._last
        if last is not None and not last.done():
            await asyncio.wait([last])

    async def _writer(self) -> None:
        assert self._wake is not None and self._thread is not None
        loop, thread = asyncio.get_running_loop(), self._thread
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                try:
                    results = await loop.run_in_executor(
                        thread, self._write, [beat for beat, _ in batch]
                    )
                except Exception as exc:
                    if not isinstance(exc, ApiError):  # an outage has logged its own line
                        log.warning("writing %d heartbeats failed: %r", len(batch), exc)
                    for _, waiter in batch:
                        if not waiter.done():
                            waiter.set_exception(exc)
                    continue
                for (_, waiter), result in zip(batch, results, strict=True):
                    if not waiter.done():
                        waiter.set_result(result)


class Heartbeats:
    """Renews leases through the group commit and answers with the engine's target.

    A beat whose engine the fleet snapshot shows leased to the sender (for
    `ANSWER_FIRST_MARGIN_S` more at least) is answered at once and committed behind: its
    lease is alive in the database already (leases only move forward), and the answer's
    lease end (the time of the answer plus the lease) is one the commit, a moment later,
    only extends. When a version lands, every engine of the fleet turns syncing and beats
    within a few hundred ms; beats that waited for their commit queued behind batches
    that took up to 0.2 s each on a busy core (p99 0.4-0.8 s at 1,000 engines).

    The beat's state still reaches the snapshot after its commit, and the engine listings
    wait for the commits queued before them (`GroupCommit.flushed`), so nobody reads back
    from this process a state the database does not hold yet (another replica may read it
    a moment before the commit). A beat waits for its commit when its engine is not in the
    snapshot (registered since its read), is another token's, is in an outage, or had a
    beat answered first that its commit refused (deregistered through another replica
    since the read): that one gets the 404 that makes it register anew. A failed commit
    (the database went away) is an outage, whose recovery renews the leases it would have
    let lapse.
    """

    def __init__(
        self,
        registry: Registry,
        runs: Runs,
        fleet: Fleet,
        outage: Outage,
        metrics: Metrics | None = None,
    ) -> None:
        self.registry = registry
        self.runs = runs
        self.fleet = fleet
        self.outage = outage
        self.writer = GroupCommit(self._write)
        self.metrics = metrics or Metrics()
        # Engines whose beat, answered first, the commit refused: they wait for commits.
        self._refused: set[str] = set()
        # Told of every fetch report a heartbeat carries (the convergence record).
        self.fetch_observers: list[Callable[[EngineView, FetchReport], None]] = []

    def _write(self, beats: Sequence[Beat]) -> list[float | None]:
        """Renew leases (after an outage, first the leases it would have let lapse)."""
        try:
            self.outage.recover()
            return self.registry.heartbeat_many(
                [(e, b) for e, b, _ in beats], [o for *_, o in beats]
            )
        except DATABASE_ERRORS as exc:
            if is_database_down(exc):
                raise self.outage.failed(exc, "heartbeats") from exc
            raise

    async def answer(self, engine_id: str, beat: Heartbeat, owner: str | None = None) -> bytes:
        """The JSON reply (`HeartbeatReply`) to one heartbeat, before or after its commit
        (see the class). `owner`: the sender's token hash (None for an admin); only the
        engine's owner renews it."""
        arrived = time.perf_counter()
        first = self._answer_first(engine_id, owner)
        if first is not None:
            self.metrics.heartbeats_answered_first.inc()
            expires = time.time() + self.registry.lease_seconds
            self.writer.enqueue((engine_id, beat, owner)).add_done_callback(
                functools.partial(self._committed_behind, engine_id, beat, arrived)
            )
            seen: EngineView | None = first
            target = self.fleet.snapshot.targets.get(engine_id)
        else:
            committed = await self.writer.submit((engine_id, beat, owner))
            if committed is None:
                # EngineNotOwned (403) or EngineUnknown (404): the failure path reads the row.
                await asyncio.to_thread(self.registry.owned, engine_id, owner)
                raise EngineUnknown(f"engine {engine_id!r} is not registered: register again")
            expires = committed
            self._committed(engine_id, beat, arrived, expires)
            snap = self.fleet.snapshot
            seen = snap.engines.get(engine_id)
            if seen is not None:
                target = snap.targets.get(engine_id)
            else:
                # Registered after the snapshot was built: it follows the latest version.
                target = await asyncio.to_thread(self._latest_for, engine_id)
        if seen is not None and beat.fetched is not None:
            for observer in self.fetch_observers:
                observer(seen, beat.fetched)
        self.metrics.heartbeat.observe(time.perf_counter() - arrived)
        return orjson.dumps({"target_version": target, "lease_expires_at": expires})

    def _answer_first(self, engine_id: str, owner: str | None) -> EngineView | None:
        """The engine's snapshot view if this beat may be answered before its commit."""
        if not self.writer.running or engine_id in self._refused or not self.outage.settled():
            return None
        seen = self.fleet.leased(engine_id, until=time.time() + ANSWER_FIRST_MARGIN_S)
        if seen is None or not (owner is None or seen.owner is None or seen.owner == owner):
            return None
        return seen

    def _committed_behind(
        self, engine_id: str, beat: Heartbeat, arrived: float, done: asyncio.Future[float | None]
    ) -> None:
        """The commit of a beat answered first (on the event loop)."""
        if done.cancelled() or done.exception() is not None:
            return  # the writer logged it; an outage renews the leases it let lapse
        expires = done.result()
        if expires is None:
            log.info(
                "engine %s: a heartbeat answered before its commit was refused by it; its "
                "next ones wait for their commits",
                engine_id,
            )
            # An engine that left the snapshot waits for its commits anyway: keep only the
            # entries that still matter, so the set never outgrows the fleet.
            engines = self.fleet.snapshot.engines
            self._refused = {e for e in self._refused if e in engines} | {engine_id}
            self.fleet.mark_dirty()
            return
        self._committed(engine_id, beat, arrived, expires)

    def _committed(self, engine_id: str, beat: Heartbeat, arrived: float, expires: float) -> None:
        """`beat` (arrived at `arrived`, perf_counter) renewed its engine's lease until
        `expires`: time it, and signal its change of state to the snapshot, if it has one."""
        self._refused.discard(engine_id)
        self.metrics.heartbeat_commit.observe(time.perf_counter() - arrived)
        seen = self.fleet.snapshot.engines.get(engine_id)
        if seen is None:
            self.fleet.mark_dirty()
        elif (
            seen.applied_version != beat.applied_version
            or seen.sync_state != beat.sync_state
            or seen.staging_target != beat.staging_target
        ):
            self.fleet.note_beat(engine_id, beat, expires)

    def _latest_for(self, engine_id: str) -> int | None:
        rows = self.registry.rows(engine_id)
        return self.runs.get(rows[0].run_id).latest_version if rows else None
