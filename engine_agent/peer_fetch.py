"""The fetch side of peer-assisted fetch: the sources one catch-up reads before the store.

For each staging pass the reconciler asks `PeerFetch.begin(version)`: the control
plane's fetch plan (peers, nearest first, and with them the version's claim and index as
the control plane read them from the store: `relayed`), then the configured fetch sources
(an HTTP cache or P2P distributor, an object-store mirror); the store always comes last
(`Store.materialize` reads it when no source delivers). After the pass, `finished` counts
where the bytes came from and reports every peer that served bad bytes, failed or stalled
to the control plane.

A plan request that fails (an overloaded control plane resets or times out calls, or the
engine is registering again after its lease lapsed) is asked again with a short jittered
backoff for `PLAN_RETRY_S`; after that the pass follows the peers of the last plan that
were fetching with this engine then (the store after them, as always). Falling back to the
store alone at the first failed call turned an overloaded control plane into store egress
(docs/peers.md, "When the control plane gives no plan").

Verification itself belongs to the store (`store.sources.SourcedFetch`, `store.relayed`);
this module must never accept bytes on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import weakref
from collections.abc import Callable

from engine_agent.control_client import ControlClient
from engine_agent.errors import AgentError
from engine_agent.status import AgentStatus, PassTimings
from store.errors import CorruptPayload
from store.relayed import RelayedVersion
from store.sources import FetchSource, FoundSources, HttpSource, ObjectSource, SourcedFetch
from store.sources.http import FetchClient, open_client
from store.types import VersionRef
from wire.peers import PEER_FILES_PATH, FetchPlan, PeerReport, PeerSource

log = logging.getLogger(__name__)

_REGISTRATION_WAIT_S = 5.0
# How long after its first try a pass asks again for a plan the control plane did not give
# (a failed call, or no engine id while registering again), and the first and the longest
# pause between tries (each jittered down by up to half, so that engines refused together
# do not ask again together).
PLAN_RETRY_S = 5.0
_PLAN_BACKOFF_FIRST_S = 0.25
_PLAN_BACKOFF_MAX_S = 2.0
# Faults worth the control plane's attention; a busy peer (503) is not one.
_REPORTED = frozenset({"digest", "size", "stall", "error"})
# A peer forwarding a file it is still receiving may be silent for this many of its own
# source timeouts (`stall_s + wait_s`): when its source fails it waits one of them, then
# its next source may wait for the file too. A child that gave up after one timeout gave
# up just before the bytes came back, and so did each level below it.
FORWARD_STALL_TIMEOUTS = 3


def open_source(
    url: str,
    token: str | None = None,
    stall_s: float = 5.0,
    client: FetchClient | None = None,
    min_bytes_per_s: float = float(1 << 20),
) -> FetchSource:
    """A configured fetch source: an http(s):// base URL or a store URL of a mirror."""
    if url.startswith(("http://", "https://")):
        return HttpSource(
            url,
            token=token,
            kind="http",
            stall_s=stall_s,
            min_bytes_per_s=min_bytes_per_s,
            client=client,
        )
    return ObjectSource.open(url)


class PeerFetch:
    """Builds each pass's `SourcedFetch` and accounts for it afterwards."""

    def __init__(
        self,
        *,
        control: ControlClient | None,
        engine_id: Callable[[], str | None],
        registered: asyncio.Event | None = None,
        own_url: str,
        token: str | None,
        status: AgentStatus,
        configured: list[str],
        peers: bool = True,
        wait_s: float = 30.0,
        stall_s: float = 5.0,
        min_bytes_per_s: float = float(1 << 20),
        first_plan_wait_s: float = 30.0,
    ) -> None:
        self.control = control
        self.engine_id = engine_id
        self.registered = registered
        self.own_url = own_url
        self.token = token
        self.status = status
        self.configured = configured
        self.peers = peers
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.min_bytes_per_s = min_bytes_per_s
        self.first_plan_wait_s = first_plan_wait_s
        # The fetch plan of the pass under way (`begin`), until `relayed` takes it.
        self._plans: dict[int, asyncio.Task[FetchPlan | None]] = {}
        # The last plan the control plane gave: its fetching peers stand in for a plan that
        # could not be had (`_fallback`).
        self.last_plan: FetchPlan | None = None
        # One HTTP client for every source of every pass (keep-alive to the same parents;
        # opening one per peer per pass is what stalled a swarm's event loop).
        self.client: FetchClient | None = None
        # The fetches handed out and not yet finished: closed with the client, so that the
        # reads it cuts short are not logged as faults of their sources.
        self._open: weakref.WeakSet[SourcedFetch] = weakref.WeakSet()

    def _opened(self, sourced: SourcedFetch) -> SourcedFetch:
        self._open.add(sourced)
        return sourced

    async def sources(self, version: int) -> SourcedFetch:
        """The sources to try for `version`'s files, in order (possibly none)."""
        found = await self._find(version, await self._plan(version))
        return self._opened(
            SourcedFetch(found.rest, lanes=found.lanes, by_version=found.by_version)
        )

    def begin(self, version: int, since: int | None = None) -> SourcedFetch:
        """`sources` without waiting: the fetch plan is asked for while the pass plans its
        catch-up, and the pass waits for it only when it first needs a source (or the plan's
        claims and indexes: `relayed`). `since`: the version the engine holds (the plan
        then carries the claims and indexes of the versions between too)."""
        loop = asyncio.get_running_loop()
        plan = loop.create_task(self._plan(version, since))
        # One pass at a time: the plan of an earlier pass is no longer wanted.
        self._plans = {version: plan}
        found = asyncio.run_coroutine_threadsafe(self._find_after(version, plan), loop)
        return self._opened(
            SourcedFetch(
                [], first=found, first_wait_s=_REGISTRATION_WAIT_S + PLAN_RETRY_S + self.wait_s
            )
        )

    async def relayed(self, run_id: str, version: int) -> dict[int, RelayedVersion]:
        """The claim and index of `version`, and of the earlier versions the plan carries,
        from the fetch plan `begin` asked for, each checked against each other; a version
        whose pair does not match (counted as `relayed` in `source_faults` and logged) is
        left out, and so is everything when the target's does: those are read from the
        store."""
        task = self._plans.pop(version, None)
        plan = await asyncio.shield(task) if task is not None else None
        if plan is None or plan.planning is None:
            return {}
        relayed = {}
        for at, files in [(version, plan.planning), *((e.version, e) for e in plan.earlier or [])]:
            if at > version or at in relayed:
                continue  # not of this chain
            try:
                relayed[at] = RelayedVersion.check(
                    VersionRef(run_id, at), files.claim.encode(), files.index.encode()
                )
            except CorruptPayload as exc:
                self.status.source_faults["relayed"] += 1
                log.warning("v%d: the control plane's claim and index refused (%s); "
                            "reading them from the store", at, exc)  # fmt: skip
                if at == version:
                    return {}
        return relayed

    async def _find_after(self, version: int, plan: asyncio.Task[FetchPlan | None]) -> FoundSources:
        return await self._find(version, await asyncio.shield(plan))

    async def _plan(self, version: int, since: int | None = None) -> FetchPlan | None:
        """The control plane's fetch plan for `version`, asked again with a jittered backoff
        for `PLAN_RETRY_S` if it fails; then `_fallback` (None: no peers to ask)."""
        if not self.peers or self.control is None:
            return None
        deadline = time.monotonic() + PLAN_RETRY_S
        pause = _PLAN_BACKOFF_FIRST_S
        while True:
            engine_id = self.engine_id()
            if engine_id is None:
                engine_id = await self._registered_id(deadline)
                if engine_id is not None:  # the tries for a plan start from the new id
                    deadline = max(deadline, time.monotonic() + PLAN_RETRY_S)
            if engine_id is None:
                failure = "this engine is not registered"
            else:
                try:
                    plan = await self.control.fetch_plan(engine_id, version, since)
                except AgentError as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                else:
                    self.last_plan = plan
                    return plan
            wait = pause * random.uniform(0.5, 1.0)
            if time.monotonic() + wait > deadline:
                return self._fallback(version, failure)
            log.info(
                "no fetch plan for v%d yet (%s); asking again in %.2fs", version, failure, wait
            )
            await asyncio.sleep(wait)
            pause = min(pause * 2, _PLAN_BACKOFF_MAX_S)

    async def _registered_id(self, deadline: float) -> str | None:
        """This engine's id; while it has none (a new agent's first catch-up starts beside
        its registration, or the control plane forgot it and it registers again), wait for
        one until `deadline`, and at least `first_plan_wait_s` from now before any plan was
        had (a new agent), `_REGISTRATION_WAIT_S` after."""
        engine_id = self.engine_id()
        if engine_id is not None or self.registered is None:
            return engine_id
        patience = _REGISTRATION_WAIT_S
        if self.last_plan is None:
            patience = max(patience, self.first_plan_wait_s)
        wait_s = max(deadline - time.monotonic(), patience)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self.registered.wait()
        return self.engine_id()

    def _fallback(self, version: int, failure: str) -> FetchPlan | None:
        """What a pass follows when the control plane gave no plan for `version`: the peers
        of the last plan (of `version`: all of them), of an earlier version: those that
        were fetching it then, nearest first, up to the first that already held it (None:
        the store only).

        Those peers are ordered as the control plane orders every fetcher (by a fixed place
        on a circle; `controlplane/fetch_plan.py`), so each comes before this engine in its
        lane in any later plan of theirs too: they never wait on this engine for a file.
        The holders of that version were ordered by id instead and may now be fetchers
        behind it, so they are left out. A peer that does not have the files is a miss or a
        fault, as in any plan, and the store serves. The plan's claim and index belong to
        its own version and are not reused."""
        last = self.last_plan
        if last is None or last.version > version:
            log.warning("no fetch plan for v%d (%s); fetching from the store", version, failure)
            return None
        lanes = last.lanes or [last.peers]
        if last.version < version:
            lanes = [_fetching(lane, last.version) for lane in lanes]
        log.warning(
            "no fetch plan for v%d (%s); following the peers of the plan for v%d: %s",
            version,
            failure,
            last.version,
            [[peer.url for peer in lane] for lane in lanes],
        )
        return FetchPlan(version=version, peers=lanes[0], lanes=lanes)

    async def _find(self, version: int, plan: FetchPlan | None) -> FoundSources:
        found = FoundSources()
        if self.client is None:
            self.client = await asyncio.to_thread(open_client)
        if plan is not None:
            by_url: dict[str, FetchSource] = {}
            found.lanes = self._lanes(plan.lanes or [plan.peers], by_url)
            found.by_version = {
                each.version: self._lanes(each.lanes, by_url)
                for each in plan.version_lanes or []
                if each.version < version
            }
            if any(found.lanes):
                log.info(
                    "v%d: fetch plan %s, then the store",
                    version,
                    [[source.location for source in lane] for lane in found.lanes],
                )
        found.rest = [
            open_source(
                url, stall_s=self.stall_s, client=self.client, min_bytes_per_s=self.min_bytes_per_s
            )
            for url in self.configured
        ]
        return found

    def _lanes(
        self, lanes: list[list[PeerSource]], by_url: dict[str, FetchSource]
    ) -> list[list[FetchSource]]:
        """One source per peer (`by_url`, shared by every version's lanes), however many
        lanes name it (a peer dropped for bad bytes in one lane is dropped in all)."""
        for lane in lanes:
            for peer in lane:
                if peer.url != self.own_url and peer.url not in by_url:
                    by_url[peer.url] = HttpSource(
                        peer.url + PEER_FILES_PATH,
                        token=self.token,
                        kind="peer",
                        wait_s=self.wait_s,
                        stall_s=self.stall_s,
                        min_bytes_per_s=self.min_bytes_per_s,
                        client=self.client,
                        forward_stall_s=FORWARD_STALL_TIMEOUTS * (self.stall_s + self.wait_s),
                    )
        return [[by_url[p.url] for p in lane if p.url in by_url] for lane in lanes]

    async def finished(self, sourced: SourcedFetch, timings: PassTimings) -> None:
        """Count the pass's bytes by source and report the peers that misbehaved."""
        for kind, size in sourced.bytes_from.items():
            timings.bytes_from[kind] = timings.bytes_from.get(kind, 0) + size
            self.status.fetched_bytes[kind] += size
        self.status.rejected_bytes += sourced.bytes_rejected
        engine_id = self.engine_id()
        for fault in sourced.faults:
            self.status.source_faults[fault.reason] += 1
            if (
                fault.source.kind != "peer"
                or fault.reason not in _REPORTED
                or self.control is None
                or engine_id is None
            ):
                continue
            peer_url = fault.source.location.removesuffix(PEER_FILES_PATH)
            try:
                await self.control.report_peer(
                    engine_id,
                    PeerReport(
                        peer_url=peer_url,
                        reason=fault.reason,
                        key=fault.key[:1000],
                        version=timings.target,
                        message=fault.message[:2000],
                    ),
                )
            except AgentError as exc:
                log.warning("could not report peer %s: %s", peer_url, exc)
        sourced.close()

    def close(self) -> None:
        """Release the shared HTTP client (when the agent stops), after closing the fetches
        still using it (their worker threads may be mid-read)."""
        for sourced in list(self._open):
            sourced.close()
        if self.client is not None:
            self.client.close()
            self.client = None


def _fetching(lane: list[PeerSource], version: int) -> list[PeerSource]:
    """The peers of `lane` (nearest first) before the first one that held `version`."""
    kept = []
    for peer in lane:
        if peer.applied_version is not None and peer.applied_version >= version:
            break
        kept.append(peer)
    return kept
