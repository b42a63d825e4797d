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
(see `_Lane`). The first 1/fanout of a lane's order are its interior nodes, so each
fetcher is interior in one lane: it uploads about what it downloads, and receives its
shards from `fanout` parents at once, each at 1/fanout of a link. A fetcher's place and
each lane's starting point do not depend on who else is in the snapshot, so a parent
always comes before its child in its lane whenever either asked: no two engines ever wait
on each other for a file, and the store serves each file about once per version.

That layout suits the engines that were there when V was published, which ask together.
Engines that register later (a fleet starting from nothing, or growing) ask one at a
time, each from a snapshot that lists only those before it; they are dealt to the lanes
in turn by the order they registered in and take the next free places of the trees
(`_Lane`), so a cold start forms the same balanced trees as a fleet that waited.

Holders are dealt out to the lanes too (by registration, in turn), each heading one lane
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
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from controlplane.snapshot import EngineView, FleetSnapshot, published_at
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
    # Engines registered after the publication are placed by registration (`_Lane`); a
    # version no snapshot of this process showed as the newest places everyone by place.
    found = published_at(run_id, version)
    published = math.inf if found is None else found
    if engine_id in orders.fetcher_ids:
        lanes = orders.lanes(fanout, published)
    else:
        # The requester is a fetcher whatever the snapshot says of it yet (one that does
        # not list it yet: it registered just now).
        view = snapshot.engines.get(engine_id)
        registered = view.registered_at if view is not None else math.inf
        lanes = _lanes(
            [h for h in orders.holders if h[1] != engine_id],
            [*orders.fetchers, (_point(engine_id), engine_id, registered)],
            fanout,
            published,
        )
    peers = []
    for lane in lanes:
        peers.append(
            [
                PeerSource(
                    engine_id=parent, url=orders.by_id[parent].url,
                    applied_version=orders.by_id[parent].applied_version,
                )
                for parent in lane.parents(engine_id, fanout, plan_size)
            ]
        )  # fmt: skip
    return FetchPlan(version=version, peers=peers[0], lanes=peers)


@functools.lru_cache(maxsize=1 << 16)
def _point(engine_id: str) -> float:
    """`engine_id`'s fixed place on a circle of circumference 1."""
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


_OTHERS, _LATE = 1, 2  # `_Lane` groups after the tree (0)


@dataclass(frozen=True)
class _Lane:
    """One lane's tree. In heap order (the parent of place i is place (i - 1) // fanout):
    `tree`, the lane's holders, then its own early fetchers (registered before the
    version was published, placed in the lane's share of the circle) by place, then its
    own late fetchers (registered after it) by registration; then `others`, the other
    early fetchers, backwards round the circle from the lane's start. `late`, the other
    late fetchers by registration, are leaves only: each hangs under the late engine of
    this lane ranked just before it (`leaf_parents`: its place in `tree`), or, when none
    is, under the last of the holders and early fetchers, or nobody (it reads this lane
    from the store). A late engine's own lane is its rank among the late engines
    (fetchers and holders, by registration) modulo `fanout` (`_lanes`).

    Why two orders. Early fetchers ask for their plans together, from snapshots that list
    them all: laid out by place, each lane's share is its interior and the rest its
    leaves, and every parent has `fanout` children. Late ones (a fleet that starts, or
    grows) ask one at a time, each seeing only those registered before it, and keep their
    parents for their whole pass. Laid out by place, a newcomer landed anywhere in its
    lane, near the top as often as not, and the first parents were named by about
    fanout · ln n children (10 to 15 at 200 to 1,000 engines, simulated) while the lanes
    below them ran at a fraction of a link. By place for the lane and by registration
    within it, a streak of newcomers placed in one lane (8 in a row among 200) all hung
    under the same parent. By rank, lanes take newcomers in turn: each takes the next
    free place of its own tree and hangs under the one that came just before it in each
    other lane, so no parent is named by more than `fanout` + `fanout` - 1 children (3
    at 2 lanes, simulated from 6 to 1,000 engines, with or without holders and engines
    finishing while others arrive). Where a leaf hangs depends on the ranks alone, not on
    which engines the snapshot of its plan listed: hung under the c-th own fetcher when
    the lane had that many, else under its last, a leaf took a fourth child's share
    whenever the next own fetcher had not registered yet when it asked (a 30-engine cold
    start: one parent of four, the lane below it at a quarter of a link).

    Backwards round the circle: a lane short of its share of the circle (the shares differ
    by about √n engines by chance) takes the rest of its interior from the start of
    `others`: forwards, that was the next lane's first engines, its root among them (a
    whole lane at half rate: 2.06× one engine's catch-up at 1,000 engines); backwards,
    the previous lane's last ones.

    Every parent comes before its child whatever the snapshot: holders hold the version,
    an early fetcher's parents are holders or early fetchers placed before it, a late
    own fetcher's parents registered before it, and late others are never parents. The
    orders depend on places, registration times and the publication time only, which
    every replica reads alike (a replica that never saw the version as the newest lays
    every fetcher out by place)."""

    tree: list[str]
    others: list[str]
    late: list[str]
    leaf_parents: dict[str, int]
    _where: dict[str, tuple[int, int]] = field(default_factory=dict)

    def parents(self, engine_id: str, fanout: int, plan_size: int) -> list[str]:
        """`engine_id`'s ancestors in this lane, nearest first, at most `plan_size`."""
        if not self._where:
            for group, members in enumerate((self.tree, self.others, self.late)):
                self._where.update((e, (group, rank)) for rank, e in enumerate(members))
        group, rank = self._where[engine_id]
        chain: list[int] = []
        index = rank + (len(self.tree) if group == _OTHERS else 0)
        if group == _LATE:
            if self.tree:
                index = self.leaf_parents[engine_id]
                if index < 0:
                    return []
                chain.append(index)
            else:  # no holder and no own fetcher: the others, then the late ones, in turn
                index = len(self.others) + rank
        while index > 0 and len(chain) < plan_size:
            index = (index - 1) // fanout
            chain.append(index)
        return [self._at(i) for i in chain[:plan_size]]

    def _at(self, index: int) -> str:
        """The engine at `index` of the heap: `tree`, then `others`, then `late`."""
        for members in (self.tree, self.others):
            if index < len(members):
                return members[index]
            index -= len(members)
        return self.late[index]


def _lanes(
    holders: list[tuple[float, str]],
    fetchers: list[tuple[float, str, float]],
    fanout: int,
    published: float,
) -> list[_Lane]:
    """Each lane's tree over `holders` (registration time, id) and `fetchers` (place, id,
    registration time).

    Engines registered after the publication are ranked by registration, holders among
    them (those that finished keep their rank), and belong to lane rank % fanout: a late
    holder heads the lane it led as a fetcher, so it never gains children in a second
    lane while its first lane's children still read from it. Earlier holders are dealt
    out to the lanes in turn, by registration."""
    early = sorted((place, e) for place, e, registered in fetchers if registered <= published)
    ranked = sorted(
        [(r, e, True) for _, e, r in fetchers if r > published]
        + [(r, h, False) for r, h in holders if r > published]
    )
    late = [(rank % fanout, e, fetching) for rank, (_, e, fetching) in enumerate(ranked)]
    first = [h for r, h in sorted(holders) if r <= published]
    lanes = []
    for lane in range(fanout):
        low, high = lane / fanout, (lane + 1) / fanout
        start = bisect.bisect_left(early, (low, ""))
        end = bisect.bisect_left(early, (high, ""))
        others = [early[(start - 1 - j) % len(early)][1] for j in range(len(early) - (end - start))]
        held = [
            *first[lane::fanout],
            *(e for own, e, fetching in late if own == lane and not fetching),
        ]
        tree = [
            *held,
            *(e for _, e in early[start:end]),
            *(e for own, e, fetching in late if own == lane and fetching),
        ]
        at = {e: i for i, e in enumerate(tree)}
        # Before any late engine of this lane: the last early fetcher, else the last of
        # the first holders, else nobody.
        before = len(held) + (end - start) - 1 if end > start else len(first[lane::fanout]) - 1
        leaf_parents = {}
        for own, e, fetching in late:
            if own == lane:
                before = at[e]
            elif fetching:
                leaf_parents[e] = before
        lanes.append(
            _Lane(
                tree=tree,
                others=others,
                late=[e for own, e, fetching in late if own != lane and fetching],
                leaf_parents=leaf_parents,
            )
        )
    return lanes


@dataclass(frozen=True)
class _Orders:
    """A run's engines that can serve version V, as one snapshot shows them: `holders`
    (registration time, id), `fetchers` (place on the circle, id, registration time) and
    each by id; the lanes over them are built once per fanout and publication time."""

    holders: list[tuple[float, str]]
    fetchers: list[tuple[float, str, float]]
    by_id: dict[str, EngineView]
    fetcher_ids: frozenset[str]
    _lanes: dict[tuple[int, float], list[_Lane]] = field(default_factory=dict)

    def lanes(self, fanout: int, published: float) -> list[_Lane]:
        key = (fanout, published)
        found = self._lanes.get(key)
        if found is None:
            found = self._lanes[key] = _lanes(self.holders, self.fetchers, fanout, published)
        return found


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
        # By registration: those that were there first keep the top of the lanes while
        # engines that came later finish and join them.
        holders=sorted((e.registered_at, e.engine_id) for e in holders),
        fetchers=[(_point(e.engine_id), e.engine_id, e.registered_at) for e in fetchers],
        by_id={e.engine_id: e for e in [*holders, *fetchers]},
        fetcher_ids=frozenset(e.engine_id for e in fetchers),
    )
    if len(_ORDERS) >= _ORDERS_KEPT:
        _ORDERS.pop(next(iter(_ORDERS)))
    _ORDERS[key] = (snapshot, orders)
    return orders
