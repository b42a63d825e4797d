"""Fetch plans: which peers an engine catching up to a version should ask, in which order.

The control plane knows from heartbeats what every engine of a run applied and where the
policy sends it. For a version V it orders the run's engines into one list: first those
that already applied V or later (holders), then those catching up to V or later (fetchers),
each group by engine id. In that list every engine's parent is the one at `(i - 1) //
fanout`, so the engines form a `fanout`-ary tree whose root is the first holder, or (when
nobody holds V yet) the first fetcher, which reads the store. An engine's plan is its
ancestors, nearest first, at most `plan_size` of them; the store always comes after them.
Within the fetchers a parent always has a smaller id than its child, so no two engines
ever wait on each other, and the store serves each file about once per version.

Peers reported for bad bytes or stalls are left out of every plan for `suspect_s`
(per process: each replica learns from the reports it receives). This module reads a fleet
snapshot only; it never touches the database or the network.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from controlplane.snapshot import EngineView, FleetSnapshot
from wire import SyncState
from wire.peers import FetchPlan, PeerReport, PeerSource

log = logging.getLogger(__name__)

_NOT_A_SOURCE = frozenset({SyncState.ERROR, SyncState.DRAINING})


class Suspects:
    """Peers recently reported for bad bytes, failures or stalls, by URL, until a deadline."""

    def __init__(self, suspect_s: float) -> None:
        self.suspect_s = suspect_s
        self._until: dict[str, float] = {}

    def report(self, reporter: str, report: PeerReport, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until[report.peer_url] = now + self.suspect_s
        log.warning(
            "engine %s reports peer %s (%s) for %s: %s",
            reporter,
            report.peer_url,
            report.reason,
            report.key or f"v{report.version}",
            report.message[:300],
        )

    def current(self, now: float | None = None) -> frozenset[str]:
        now = time.monotonic() if now is None else now
        for url in [u for u, until in self._until.items() if until <= now]:
            del self._until[url]
        return frozenset(self._until)


def plan_fetch(
    snapshot: FleetSnapshot,
    engine_id: str,
    run_id: str,
    version: int,
    *,
    fanout: int,
    plan_size: int,
    suspects: Iterable[str] = (),
) -> FetchPlan:
    """The fetch plan of `engine_id` (of `run_id`) catching up to `version`."""
    if plan_size <= 0 or fanout <= 0:
        return FetchPlan(version=version)
    excluded = set(suspects)
    holders: list[EngineView] = []
    fetchers: list[EngineView] = []
    for engine in snapshot.run_engines(run_id):
        if engine.engine_id == engine_id:
            continue
        if engine.url in excluded or engine.sync_state in _NOT_A_SOURCE:
            continue
        applied = engine.applied_version
        if applied is not None and applied >= version:
            holders.append(engine)
            continue
        heading = max(
            (
                v
                for v in (snapshot.target_for(engine.engine_id, run_id), engine.staging_target)
                if v is not None
            ),
            default=None,
        )
        if heading is not None and heading >= version:
            fetchers.append(engine)
    holders.sort(key=lambda e: e.engine_id)
    # The requester takes its place among the fetchers by id (it is one, whatever the
    # snapshot says of it yet): then every parent of a fetcher has a smaller id.
    ranked = sorted([*(e.engine_id for e in fetchers), engine_id])
    order = [e.engine_id for e in holders] + ranked
    by_id = {e.engine_id: e for e in [*holders, *fetchers]}
    peers: list[PeerSource] = []
    index = order.index(engine_id)
    while index > 0 and len(peers) < plan_size:
        index = (index - 1) // fanout
        parent = by_id[order[index]]
        peers.append(
            PeerSource(
                engine_id=parent.engine_id, url=parent.url, applied_version=parent.applied_version
            )
        )
    return FetchPlan(version=version, peers=peers)
