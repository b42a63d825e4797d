"""Fetch plans: which peers an engine catching up to a version should ask, in which order.

The control plane knows from heartbeats what every engine of a run applied and where the
policy sends it. For a version V it orders the run's engines into one list: first those
that already applied V or later (holders), then those catching up to V or later
(fetchers, by their place on a circle, below). In that list every engine's parent is the
one at `(i - 1) // fanout`, so the engines form a `fanout`-ary tree whose root is the
first holder, or (when nobody holds V yet) the first fetcher, which reads the store. An
engine's ancestors, nearest first, at most `plan_size` of them, are its plan; the store
always comes after them.

One tree makes every child share its parent's upload with `fanout - 1` siblings, so a leaf
receives at 1/fanout of a link. So there are `fanout` trees (lanes) over the same engines,
and a version's shards are dealt out to them in turn: each fetcher has a fixed place on a
circle (a hash of its id), and lane k orders first its own fetchers (those placed from
k/fanout to (k+1)/fanout of the way round), then the others backwards round the circle
(see `_LaneOrder`). The first 1/fanout of a lane's order are its interior nodes, so each
fetcher is interior in one lane: it uploads about what it downloads, and receives its
shards from `fanout` parents at once, each at 1/fanout of a link. A fetcher's place and
each lane's starting point do not depend on who else is in the snapshot, so a parent
always comes before its child in its lane whenever either asked: no two engines ever wait
on each other for a file, and the store serves each file about once per version.

Holders are dealt out to the lanes too (by engine id, in turn), each heading one lane
only. A holder at the top of every lane served `fanout` children in each, `fanout`² at
once, so every lane below it ran at 1/fanout of a link and the holder's upload slots
turned children away. A lane left without a holder (fewer holders than lanes) is rooted
at its first fetcher, on the store: that costs the store at most (fanout − 1)/fanout of
the version, once.

Peers reported for bad bytes or stalls are left out of every plan for `suspect_s`
(per process: each replica learns from the reports it receives). This module reads a fleet
snapshot only; it never touches the database or the network.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

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
    orders = _orders(snapshot, run_id, version, frozenset(suspects))
    # The requester is a fetcher whatever the snapshot says of it yet.
    holders = [h for h in orders.holders if h != engine_id]
    fetchers = orders.fetchers
    me = (_point(engine_id), engine_id)
    mine = bisect.bisect_left(fetchers, me)
    if mine == len(fetchers) or fetchers[mine] != me:
        fetchers = [*fetchers[:mine], me, *fetchers[mine:]]
    lanes = []
    for lane in range(fanout):
        start = bisect.bisect_left(fetchers, (lane / fanout, ""))
        end = bisect.bisect_left(fetchers, ((lane + 1) / fanout, ""))
        order = _LaneOrder(holders[lane::fanout], fetchers, start, end)
        peers: list[PeerSource] = []
        index = len(order.holders) + order.place(mine)
        while index > 0 and len(peers) < plan_size:
            index = (index - 1) // fanout
            parent = orders.by_id[order[index]]
            peers.append(
                PeerSource(
                    engine_id=parent.engine_id,
                    url=parent.url,
                    applied_version=parent.applied_version,
                )
            )
        lanes.append(peers)
    return FetchPlan(version=version, peers=lanes[0], lanes=lanes)


@functools.lru_cache(maxsize=1 << 16)
def _point(engine_id: str) -> float:
    """`engine_id`'s fixed place on a circle of circumference 1."""
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class _Orders:
    """A run's engines that can serve version V, as one snapshot shows them: `holders` (by
    id), `fetchers` (by place on the circle, as (place, id)) and each by id."""

    holders: list[str]
    fetchers: list[tuple[float, str]]
    by_id: dict[str, EngineView]


@dataclass(frozen=True)
class _LaneOrder:
    """Lane order without building it: the lane's holders, then its own fetchers (those
    placed from its starting point to the next lane's, `start` to `end` in `fetchers`) in
    circle order, then every other fetcher backwards round the circle from `start`.

    Backwards: the tree's interior is the first 1/fanout of the order, and the lanes' own
    shares of the circle differ by chance (about √n engines). A lane short of its share
    takes the rest of its interior from where the other fetchers come after it: forwards,
    that was the next lane's own first engines, its root among them, and that root then
    shared its upload with twice the children and halved everything below it (a whole
    lane at half rate: 2.06× one engine's catch-up at 1,000 engines, 2.3× at 30).
    Backwards, they are the previous lane's last engines, which are its leaves when it has
    more than its share. Whatever the snapshot, two fetchers keep their order in a lane
    (it depends on their places only)."""

    holders: list[str]
    fetchers: list[tuple[float, str]]
    start: int
    end: int

    def __getitem__(self, index: int) -> str:
        if index < len(self.holders):
            return self.holders[index]
        at = index - len(self.holders)
        own = self.end - self.start
        if at < own:
            return self.fetchers[self.start + at][1]
        return self.fetchers[(self.start - 1 - (at - own)) % len(self.fetchers)][1]

    def place(self, mine: int) -> int:
        """Where the fetcher at `mine` in `fetchers` comes in this lane's fetchers."""
        if self.start <= mine < self.end:
            return mine - self.start
        return self.end - self.start + (self.start - 1 - mine) % len(self.fetchers)


# The orders of the last few (snapshot, run, version, suspects) asked about: at scale many
# engines ask for the same version's plan between two snapshots.
_ORDERS: dict[tuple[int, str, int, frozenset[str]], tuple[FleetSnapshot, _Orders]] = {}
_ORDERS_KEPT = 16


def _orders(
    snapshot: FleetSnapshot, run_id: str, version: int, excluded: frozenset[str]
) -> _Orders:
    key = (id(snapshot), run_id, version, excluded)
    cached = _ORDERS.get(key)
    if cached is not None and cached[0] is snapshot:
        return cached[1]
    holders: list[EngineView] = []
    fetchers: list[EngineView] = []
    for engine in snapshot.run_engines(run_id):
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
    orders = _Orders(
        holders=sorted(e.engine_id for e in holders),
        fetchers=sorted((_point(e.engine_id), e.engine_id) for e in fetchers),
        by_id={e.engine_id: e for e in [*holders, *fetchers]},
    )
    if len(_ORDERS) >= _ORDERS_KEPT:
        _ORDERS.pop(next(iter(_ORDERS)))
    _ORDERS[key] = (snapshot, orders)
    return orders
