"""Target-version policies: which version each engine is told to converge to.

Pure functions over plain values; no database, no clock, no I/O. `follow_latest` sends every
engine to the run's latest version. `keep_pinned` additionally keeps `k` engines on each
version that exact-version requests asked for recently (and that is not too far behind),
preferring engines already on it, chosen by rendezvous hashing so the choice is stable.
A version the store no longer holds (garbage-collected) is never pinned: an engine sent
there could only fail, so it keeps following latest.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import xxhash

from wire import PolicyKind, TargetPolicy


@dataclass(frozen=True)
class PolicyEngine:
    """What a policy needs to know about one engine."""

    engine_id: str
    applied_version: int | None
    eligible: bool  # False while draining or in error: never pinned


def rendezvous_score(key: str, engine_id: str) -> int:
    return xxhash.xxh64_intdigest(f"{key}\x00{engine_id}".encode())


def active_pins(
    policy: TargetPolicy,
    latest: int | None,
    demand: Mapping[int, float],
    now: float,
    available: Collection[int] | None = None,
) -> list[int]:
    """The versions keep_pinned must keep serviceable now, newest first. `available`: the
    versions the store holds (None: unknown, every demanded version counts)."""
    if policy.kind is not PolicyKind.KEEP_PINNED or latest is None:
        return []
    return sorted(
        (
            v
            for v, last in demand.items()
            if now - last <= policy.window_s
            and v < latest
            and latest - v <= policy.max_lag
            and (available is None or v in available)
        ),
        reverse=True,
    )


def _pin_order(version: int, engine: PolicyEngine) -> tuple[bool, int]:
    """Engines already on the pinned version first, then a stable per-version order."""
    return engine.applied_version != version, -rendezvous_score(f"pin:{version}", engine.engine_id)


def assign_targets(
    policy: TargetPolicy,
    latest: int | None,
    engines: Iterable[PolicyEngine],
    demand: Mapping[int, float],
    now: float,
    available: Collection[int] | None = None,
) -> dict[str, int | None]:
    """Each engine's target version under `policy` (None while the run has no version)."""
    engines = list(engines)
    targets: dict[str, int | None] = {e.engine_id: latest for e in engines}
    taken: set[str] = set()
    for version in active_pins(policy, latest, demand, now, available):
        candidates = [e for e in engines if e.eligible and e.engine_id not in taken]
        candidates.sort(key=partial(_pin_order, version))
        for engine in candidates[: policy.engines]:
            targets[engine.engine_id] = version
            taken.add(engine.engine_id)
    return targets
