"""The reconciler: bring the engine to its target version, staging while it serves.

One pass (after Stitch's agent): read the target (the control plane's assignment, else the
store pointer) → materialize its canonical tensors from what the agent holds (the applied
version's tensors) or the nearest FULL anchor, every target checksum verified → convert to
the engine's precision and write the staged folder (`engine_agent.staging`) — all while the
engine serves — then commit:

1. close the admission gate (new requests wait there, bounded);
2. wait for exact-version requests in flight on the old version (bounded); `quiesce` also
   waits for every other request;
3. pause the engine, `update_weights_from_disk(staged, weight_version=str(v))`, continue;
4. flip the served version and reopen the gate.

If the target moved while staging, the pass stages once more (from the tensors it just
built) before committing. A failed stage (a missing or corrupt version, a full disk) leaves
the engine untouched and serving: `last_error` is set, the failure is counted, and the pass is
retried with exponential backoff (ended early by `retry_now`). A failed commit raises
`UnrecoverableEngineError`: the engine's weights are undefined and the replica must go.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_never,
    wait_exponential,
)

from engine_agent.engines.base import Engine, PauseMode
from engine_agent.errors import (
    EngineRefused,
    EngineUnreachable,
    StageFailed,
    UnrecoverableEngineError,
)
from engine_agent.gate import AdmissionGate
from engine_agent.peer_fetch import PeerFetch
from engine_agent.staging import StagedCheckpoint, Stager
from engine_agent.status import AgentStatus, PassTimings
from store.catchup import CatchUpPlan
from store.errors import StoreError
from store.store import Store
from store.tensors import RawTensor

log = logging.getLogger(__name__)

# Share of staging_progress reported once the tensors are folded and verified.
_FOLDED_PROGRESS = 0.7
_CONVERTED_PROGRESS = 0.9


class Reconciler:
    """Drives one engine to its target; `run()` is the loop, `wake()` asks for a pass now."""

    def __init__(
        self,
        *,
        engine: Engine,
        gate: AdmissionGate,
        store: Store,
        stager: Stager,
        status: AgentStatus,
        run_id: str,
        pause_mode: PauseMode = PauseMode.IN_PLACE,
        exact_drain_s: float = 30.0,
        quiesce_drain_s: float = 60.0,
        poll_s: float = 1.0,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 30.0,
        follow_control_plane: bool = False,
        on_change: Callable[[], Awaitable[None]] | None = None,
        fetch: PeerFetch | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.gate = gate
        self.store = store
        self.stager = stager
        self.status = status
        self.run_id = run_id
        self.pause_mode = pause_mode
        self.exact_drain_s = exact_drain_s
        self.quiesce_drain_s = quiesce_drain_s
        self.poll_s = poll_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.follow_control_plane = follow_control_plane
        self.on_change = on_change
        # Peer-assisted fetch: the sources tried before the store (None: the store only).
        self.fetch = fetch
        self.on_commit = on_commit
        # The versions the running pass downloads: None before it has planned (or when no
        # pass runs), empty after it failed. Peers wait only for files it will fetch.
        self.fetching: frozenset[int] | None = None
        self.assigned: int | None = None
        # False while no control plane answers: the store pointer is the target meanwhile.
        self.control_plane_reachable = True
        self._wake = asyncio.Event()
        self._retry = asyncio.Event()
        # The canonical tensors of the applied version, the base of the next catch-up.
        self._canonical: Mapping[str, RawTensor] | None = None
        self._canonical_version: int | None = None

    # ---- inputs --------------------------------------------------------------------------

    def wake(self) -> None:
        """Run a pass soon (a new assignment, or a request asking for a newer version)."""
        self._wake.set()

    def retry_now(self) -> None:
        """End the backoff after a failed pass (e.g. the engine answers again)."""
        self._retry.set()
        self._wake.set()

    def assign(self, target: int | None) -> None:
        """The control plane's assignment for this engine."""
        if target != self.assigned:
            log.info("run %s: control plane assigns v%s", self.run_id, target)
        self.assigned = target
        self.wake()

    def hold(self, version: int, tensors: Mapping[str, RawTensor]) -> None:
        """The canonical tensors of `version`, which the engine serves (e.g. its boot)."""
        self._canonical, self._canonical_version = tensors, version

    async def current_target(self) -> int | None:
        """The control plane's assignment, else (before it has one, or while no control
        plane answers) the store pointer."""
        if self.follow_control_plane and self.control_plane_reachable and self.assigned is not None:
            return self.assigned
        pointer = await asyncio.to_thread(self.store.read_pointer, self.run_id)
        return pointer.version if pointer is not None else None

    # ---- loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Reconcile until cancelled; raise `UnrecoverableEngineError` if a commit fails.

        A failed pass is retried with exponential backoff (`retry_initial_s` doubling up to
        `retry_max_s`); a pass that succeeds resets it."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type((StageFailed, StoreError, EngineUnreachable, OSError)),
            wait=wait_exponential(multiplier=self.retry_initial_s, max=self.retry_max_s),
            before_sleep=self._failed_pass,
            sleep=self._backoff,
            stop=stop_never,
        )
        while True:
            await retrying(self.reconcile_once)
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def _failed_pass(self, state: RetryCallState) -> None:
        """Record a failed pass in the status before the backoff sleep."""
        failure = state.outcome.exception() if state.outcome is not None else None
        self.status.last_error = f"{type(failure).__name__}: {failure}"
        self.status.failures[type(failure).__name__] += 1
        self.status.staging_target = None
        self.status.staging_progress = 0.0
        log.warning(
            "run %s: reconcile pass failed (retry in %.1fs): %s",
            self.run_id,
            state.next_action.sleep if state.next_action is not None else 0.0,
            self.status.last_error,
        )
        await self._changed()

    async def _backoff(self, seconds: float) -> None:
        """The wait between failed passes; `retry_now` ends it early."""
        self._retry.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._retry.wait()

    async def reconcile_once(self) -> bool:
        """One pass; True if it committed a new version."""
        target = await self.current_target()
        applied = self.status.applied_version
        if target is None or target == applied:
            if not self.status.caught_up and (target is not None or applied is not None):
                self.status.caught_up = True
                log.info("run %s: caught up at v%s", self.run_id, applied)
                await self._changed()
            return False
        if not self.status.engine_reachable:
            raise EngineUnreachable(
                f"engine at {self.engine.url} is unreachable; v{target} waits until it answers"
            )
        timings = PassTimings(target=target, base=self._canonical_version)
        self.status.passes.append(timings)
        started = time.perf_counter()
        self.status.staging_target = target
        self.status.staging_progress = 0.0
        await self._changed()
        try:
            tensors, staged = await self._stage(target, timings)
            newer = await self.current_target()
            if newer is not None and newer != target:
                log.info(
                    "run %s: target moved to v%s while staging v%s", self.run_id, newer, target
                )
                timings.restaged_for = newer
                self.status.staging_target = newer
                tensors, staged = await self._stage(newer, timings, base=(target, tensors))
            timings.stage_s = time.perf_counter() - started
            await self._commit(staged, timings)
        except BaseException as exc:
            timings.outcome = f"failed: {type(exc).__name__}"
            timings.finished_at = time.time()
            raise
        self._canonical, self._canonical_version = tensors, staged.version
        self.stager.prune({staged.version})
        self.fetching = None
        if self.on_commit is not None:
            self.on_commit(staged.version)
        timings.committed = staged.version
        timings.outcome = "committed"
        timings.finished_at = time.time()
        log.info("run %s: pass timings %s", self.run_id, timings.as_dict())
        self.status.staging_target = None
        self.status.staging_progress = 0.0
        self.status.last_error = None
        self.status.caught_up = True
        await self._changed()
        return True

    # ---- staging -------------------------------------------------------------------------

    async def _stage(
        self,
        target: int,
        timings: PassTimings,
        base: tuple[int, Mapping[str, RawTensor]] | None = None,
    ) -> tuple[Mapping[str, RawTensor], StagedCheckpoint]:
        have, tensors = base if base is not None else (self._canonical_version, self._canonical)
        started = time.perf_counter()
        fetched_at = started

        def progress(done: int, total: int, what: str) -> None:
            nonlocal fetched_at
            if what.startswith("fetched"):
                fetched_at = time.perf_counter()
            self.status.staging_progress = _FOLDED_PROGRESS * done / max(total, 1)

        if have is None or tensors is None:
            have, tensors = None, None
        # The fetch plan; with it (when it names peers) the claims and indexes of the target
        # and of the versions since `have` as the control plane read them from the store,
        # so that the catch-up is planned and verified without reading them again (waiting
        # for the plan replaces those reads).
        sources = self.fetch.begin(target, have) if self.fetch is not None else None
        relayed = await self.fetch.relayed(self.run_id, target) if self.fetch is not None else {}
        self.fetching = None

        def planned(plan: CatchUpPlan) -> None:
            self.fetching = frozenset(plan.downloads)

        try:
            try:
                canonical = await asyncio.to_thread(
                    self.store.materialize,
                    self.run_id,
                    target,
                    base=tensors,
                    have=have,
                    progress=progress,
                    sources=sources,
                    on_plan=planned,
                    relayed=relayed,
                )
            except StoreError as exc:
                if have is None:
                    raise
                # The held tensors may not be the chain's base (e.g. a boot folder from
                # elsewhere): fall back to the nearest FULL anchor.
                log.warning(
                    "run %s: catch-up from v%s failed (%s); from anchor", self.run_id, have, exc
                )
                canonical = await asyncio.to_thread(
                    functools.partial(
                        self.store.materialize,
                        self.run_id,
                        target,
                        progress=progress,
                        sources=sources,
                        on_plan=planned,
                        relayed=relayed,
                    )
                )
        except StoreError as exc:
            self.fetching = frozenset()
            raise StageFailed(
                f"v{target} of run {self.run_id} could not be materialized from "
                f"{self.store.url}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if self.fetch is not None and sources is not None:
                await self.fetch.finished(sources, timings)
        timings.fetch_s += fetched_at - started
        timings.fold_verify_s += time.perf_counter() - fetched_at
        staged = await asyncio.to_thread(self.stager.stage, target, canonical)
        self.status.staging_progress = 1.0
        timings.convert_s += staged.convert_s
        timings.write_s += staged.write_s
        return canonical, staged

    # ---- commit --------------------------------------------------------------------------

    async def _commit(self, staged: StagedCheckpoint, timings: PassTimings) -> None:
        old = self.gate.served_version
        started = time.perf_counter()
        await self.gate.close()
        served = old
        try:
            pinned = await self.gate.wait_exact_drained(old, self.exact_drain_s)
            if pinned:
                log.warning(
                    "run %s: %d request(s) pinned to v%s still in flight after %.0fs; "
                    "committing v%d anyway",
                    self.run_id,
                    pinned,
                    old,
                    self.exact_drain_s,
                    staged.version,
                )
            if self.pause_mode is PauseMode.QUIESCE:
                await self.gate.wait_drained(self.quiesce_drain_s)
            paused_at = time.perf_counter()
            timings.drain_s = paused_at - started
            try:
                await self.engine.pause(self.pause_mode)
                await self.engine.load_from_disk(
                    str(staged.path.resolve()), staged.version, self.pause_mode
                )
                await self.engine.resume()
            except (EngineRefused, EngineUnreachable) as exc:
                served = None
                self.status.terminal = True
                self.status.last_error = (
                    f"UnrecoverableEngineError: commit of v{staged.version} failed: {exc}"
                )
                raise UnrecoverableEngineError(
                    f"committing v{staged.version} to the engine at {self.engine.url} failed "
                    f"({exc}); its weights are undefined, replace this replica"
                ) from exc
            timings.pause_s = time.perf_counter() - paused_at
            served = staged.version
            self.status.applied_version = staged.version
        finally:
            await self.gate.reopen(served)
        timings.commit_s = time.perf_counter() - started
        log.info(
            "run %s: engine now serves v%d (was v%s); paused %.3fs, commit %.3fs",
            self.run_id,
            staged.version,
            old,
            timings.pause_s,
            timings.commit_s,
        )

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()
