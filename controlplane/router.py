"""The routing decision: which engine serves a request, from the in-memory snapshot.

Owns eligibility (leased, serving, same run, constraint satisfied, precision allowed) and
the pick: rendezvous hashing on the session id when there is one (so a session stays put
when unrelated engines come or go), else the less loaded of two random eligible engines.
Pure and fast (no I/O, no locks); the proxy calls it again, excluding engines that failed.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping

import numpy as np
import xxhash

from controlplane.snapshot import EngineView, FleetSnapshot, Group
from store.types import VersionConstraint
from wire import Precision

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
ALL_PRECISIONS = frozenset(Precision)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised: a well-spread score for (session, engine)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    mixed: np.ndarray = x ^ (x >> _S31)
    return mixed


# Power-of-two draws when the caller brings no generator of its own.
_RANDOM = random.Random()

# One precision group's engines whose versions satisfy the constraint: group[lo:hi].
Span = tuple[Group, int, int]


def session_key(session_id: str) -> np.uint64:
    return np.uint64(xxhash.xxh64_intdigest(session_id.encode()))


def _candidates(
    snap: FleetSnapshot,
    run_id: str,
    constraint: VersionConstraint,
    precisions: Collection[Precision] | None,
) -> list[Span]:
    spans: list[Span] = []
    for precision in ALL_PRECISIONS if precisions is None else precisions:
        group = snap.groups.get((run_id, precision))
        if group is None:
            continue
        lo, hi = group.span(constraint)
        if hi > lo:
            spans.append((group, lo, hi))
    return spans


def _usable(engine: EngineView, now: float, exclude: Collection[str]) -> bool:
    return engine.lease_expires_at > now and engine.engine_id not in exclude


def _load(engine: EngineView, local_in_flight: Mapping[str, int]) -> float:
    return (engine.in_flight + local_in_flight.get(engine.engine_id, 0)) / engine.capacity


def pick(
    snap: FleetSnapshot,
    run_id: str,
    constraint: VersionConstraint,
    *,
    precisions: Collection[Precision] | None = None,
    session_id: str | None = None,
    exclude: Collection[str] = (),
    local_in_flight: Mapping[str, int] | None = None,
    now: float,
    rng: random.Random | None = None,
) -> EngineView | None:
    """The engine to send this request to, or None when no eligible engine is left."""
    spans = _candidates(snap, run_id, constraint, precisions)
    if not spans:
        return None
    if session_id is not None:
        return _by_affinity(spans, session_key(session_id), exclude, now)
    return _by_load(spans, exclude, local_in_flight or {}, now, rng or _RANDOM)


def _by_affinity(
    spans: list[Span], key: np.uint64, exclude: Collection[str], now: float
) -> EngineView | None:
    best: EngineView | None = None
    best_score = -1
    for group, lo, hi in spans:
        scores = _mix(group.seeds[lo:hi] ^ key)
        for _ in range(hi - lo):
            i = int(np.argmax(scores))
            engine = group.engines[lo + i]
            if _usable(engine, now, exclude):
                if int(scores[i]) > best_score:
                    best, best_score = engine, int(scores[i])
                break
            scores[i] = 0
    return best


def _by_load(
    spans: list[Span],
    exclude: Collection[str],
    local_in_flight: Mapping[str, int],
    now: float,
    rng: random.Random,
) -> EngineView | None:
    if len(spans) == 1:
        return _by_load_in(spans[0], exclude, local_in_flight, now, rng)
    sizes = [hi - lo for _, lo, hi in spans]
    total = sum(sizes)

    def at(k: int) -> EngineView:
        for (group, lo, _), size in zip(spans, sizes, strict=True):
            if k < size:
                return group.engines[lo + k]
            k -= size
        raise IndexError(k)

    # Power of two choices: two distinct random engines, the less loaded wins. Excluded or
    # lapsed draws fall back to a scan, which only happens while retrying. The draws
    # scale `random()` (one C call) instead of `randrange` (four Python calls); the bias
    # is below 2**-40 for any fleet under a million engines.
    first = int(rng.random() * total)
    chosen = [at(first)]
    if total > 1:
        second = int(rng.random() * (total - 1))
        chosen.append(at(second + 1 if second >= first else second))
    chosen = [e for e in chosen if _usable(e, now, exclude)]
    if not chosen:
        chosen = [e for e in (at(k) for k in range(total)) if _usable(e, now, exclude)]
        if not chosen:
            return None
    return min(chosen, key=lambda e: _load(e, local_in_flight))


def _by_load_in(
    span: Span,
    exclude: Collection[str],
    local_in_flight: Mapping[str, int],
    now: float,
    rng: random.Random,
) -> EngineView | None:
    """`_by_load` over one span (one run and precision: the usual request), with the same
    draws and the same choice, without its closure, lists and key function."""
    group, lo, hi = span
    engines, total = group.engines, hi - lo
    first = int(rng.random() * total)
    one = engines[lo + first]
    if total > 1:
        second = int(rng.random() * (total - 1))
        two = engines[lo + (second + 1 if second >= first else second)]
        if _usable(one, now, exclude):
            if not _usable(two, now, exclude):
                return one
            # `min` keeps the first of equals: the second draw wins only when less loaded.
            if _load(two, local_in_flight) < _load(one, local_in_flight):
                return two
            return one
        if _usable(two, now, exclude):
            return two
    elif _usable(one, now, exclude):
        return one
    chosen = [e for e in engines[lo:hi] if _usable(e, now, exclude)]
    if not chosen:
        return None
    return min(chosen, key=lambda e: _load(e, local_in_flight))


def eligible(
    snap: FleetSnapshot,
    run_id: str,
    constraint: VersionConstraint,
    *,
    precisions: Collection[Precision] | None = None,
    exclude: Collection[str] = (),
    now: float,
) -> list[EngineView]:
    """Every engine that could take the request now (agent sessions place by load over
    all of them, see `controlplane/placement.py`)."""
    return [
        engine
        for group, lo, hi in _candidates(snap, run_id, constraint, precisions)
        for engine in group.engines[lo:hi]
        if _usable(engine, now, exclude)
    ]


def retry_after_s(
    snap: FleetSnapshot, run_id: str, constraint: VersionConstraint, now: float, default: float
) -> float:
    """Seconds until some engine is likely to serve an acceptable version.

    Extrapolates each syncing engine's reported staging progress toward a target that
    satisfies the constraint; the soonest wins. Without such an engine: `default`.
    """
    best: float | None = None
    for engine in snap.engines.values():
        if engine.run_id != run_id or not constraint.satisfied_by(engine.staging_target):
            continue
        p, started = engine.staging_progress, engine.staging_started_at
        if started is None or p <= 0.0:
            continue
        eta = (now - started) * (1.0 - p) / p
        best = eta if best is None else min(best, eta)
    if best is None:
        return default
    return min(60.0, max(1.0, best))
