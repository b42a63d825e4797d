"""The fetch side of peer-assisted fetch: the sources one catch-up reads before the store.

For each staging pass the reconciler asks `PeerFetch.begin(version)`: the control
plane's fetch plan (peers, nearest first, and with them the version's claim and index as
the control plane read them from the store: `relayed`), then the configured fetch sources
(an HTTP cache or P2P distributor, an object-store mirror); the store always comes last
(`Store.materialize` reads it when no source delivers). After the pass, `finished` counts
where the bytes came from and reports every peer that served bad bytes, failed or stalled
to the control plane. Verification itself belongs to the store (`store.sources.SourcedFetch`,
`store.relayed`); this module must never accept bytes on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from engine_agent.control_client import ControlClient
from engine_agent.errors import AgentError
from engine_agent.status import AgentStatus, PassTimings
from store.errors import CorruptPayload
from store.relayed import RelayedVersion
from store.sources import FetchSource, FoundSources, HttpSource, ObjectSource, SourcedFetch
from store.sources.http import open_client
from store.types import VersionRef
from wire.peers import PEER_FILES_PATH, FetchPlan, PeerReport, PeerSource

log = logging.getLogger(__name__)

_REGISTRATION_WAIT_S = 5.0
# Faults worth the control plane's attention; a busy peer (503) is not one.
_REPORTED = frozenset({"digest", "size", "stall", "error"})


def open_source(
    url: str,
    token: str | None = None,
    stall_s: float = 5.0,
    client: httpx.Client | None = None,
) -> FetchSource:
    """A configured fetch source: an http(s):// base URL or a store URL of a mirror."""
    if url.startswith(("http://", "https://")):
        return HttpSource(url, token=token, kind="http", stall_s=stall_s, client=client)
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
        # The fetch plan of the pass under way (`begin`), until `relayed` takes it.
        self._plans: dict[int, asyncio.Task[FetchPlan | None]] = {}
        # One HTTP client for every source of every pass (keep-alive to the same parents;
        # opening one per peer per pass is what stalled a swarm's event loop).
        self.client: httpx.Client | None = None

    async def sources(self, version: int) -> SourcedFetch:
        """The sources to try for `version`'s files, in order (possibly none)."""
        found = await self._find(version, await self._plan(version))
        return SourcedFetch(found.rest, lanes=found.lanes)

    def begin(self, version: int) -> SourcedFetch:
        """`sources` without waiting: the fetch plan is asked for while the pass plans its
        catch-up, and the pass waits for it only when it first needs a source (or the plan's
        claim and index: `relayed`)."""
        loop = asyncio.get_running_loop()
        plan = loop.create_task(self._plan(version))
        # One pass at a time: the plan of an earlier pass is no longer wanted.
        self._plans = {version: plan}
        found = asyncio.run_coroutine_threadsafe(self._find_after(version, plan), loop)
        return SourcedFetch([], first=found, first_wait_s=_REGISTRATION_WAIT_S + self.wait_s)

    async def relayed(self, run_id: str, version: int) -> dict[int, RelayedVersion]:
        """The claim and index of `version` from the fetch plan `begin` asked for, checked
        against each other; empty (plan from the store) when the plan has none, or they do
        not match (counted as `relayed` in `source_faults` and logged)."""
        task = self._plans.pop(version, None)
        plan = await asyncio.shield(task) if task is not None else None
        if plan is None or plan.planning is None:
            return {}
        ref = VersionRef(run_id, version)
        try:
            relayed = RelayedVersion.check(
                ref, plan.planning.claim.encode(), plan.planning.index.encode()
            )
        except CorruptPayload as exc:
            self.status.source_faults["relayed"] += 1
            log.warning("v%d: the control plane's claim and index refused (%s); "
                        "reading them from the store", version, exc)  # fmt: skip
            return {}
        return {version: relayed}

    async def _find_after(self, version: int, plan: asyncio.Task[FetchPlan | None]) -> FoundSources:
        return await self._find(version, await asyncio.shield(plan))

    async def _plan(self, version: int) -> FetchPlan | None:
        """The control plane's fetch plan for `version` (None: none asked or answered)."""
        if self.peers and self.engine_id() is None and self.registered is not None:
            # A new agent's first catch-up starts beside its registration: give that a
            # moment, the plan needs the engine's id.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_REGISTRATION_WAIT_S):
                    await self.registered.wait()
        engine_id = self.engine_id()
        if not self.peers or self.control is None or engine_id is None:
            return None
        try:
            return await self.control.fetch_plan(engine_id, version)
        except AgentError as exc:
            log.info("no fetch plan for v%d (%s); fetching from the store", version, exc)
            return None

    async def _find(self, version: int, plan: FetchPlan | None) -> FoundSources:
        found = FoundSources()
        if self.client is None:
            self.client = await asyncio.to_thread(open_client)
        if plan is not None:
            found.lanes = self._lanes(plan.lanes or [plan.peers])
            if any(found.lanes):
                log.info(
                    "v%d: fetch plan %s, then the store",
                    version,
                    [[source.location for source in lane] for lane in found.lanes],
                )
        found.rest = [
            open_source(url, stall_s=self.stall_s, client=self.client) for url in self.configured
        ]
        return found

    def _lanes(self, lanes: list[list[PeerSource]]) -> list[list[FetchSource]]:
        """One source per peer, however many lanes name it (a peer dropped for bad bytes in
        one lane is dropped in all)."""
        by_url: dict[str, FetchSource] = {}
        for lane in lanes:
            for peer in lane:
                if peer.url != self.own_url and peer.url not in by_url:
                    by_url[peer.url] = HttpSource(
                        peer.url + PEER_FILES_PATH,
                        token=self.token,
                        kind="peer",
                        wait_s=self.wait_s,
                        stall_s=self.stall_s,
                        client=self.client,
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
        """Release the shared HTTP client (when the agent stops)."""
        if self.client is not None:
            self.client.close()
            self.client = None
