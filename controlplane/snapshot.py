"""An immutable in-memory picture of the fleet, built from database rows.

Owns the indices the router reads on the hot path: serving engines grouped by run and
precision and sorted by applied version (so a min or exact constraint is a bisect), the
per-engine rendezvous seeds, each run's latest version and policy, and each engine's
target as the policy assigns it. Never touches the database or the network itself: the
fleet (`controlplane/fleet.py`) builds a new snapshot and swaps it in.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import xxhash

from controlplane.policy import PolicyEngine, active_pins, assign_targets
from store.types import VersionConstraint
from wire import SERVING_STATES, Precision, SyncState, TargetPolicy


@dataclass(frozen=True)
class EngineView:
    engine_id: str
    run_id: str
    url: str
    precision: Precision
    capacity: int
    applied_version: int | None
    sync_state: SyncState
    in_flight: int
    staging_target: int | None
    staging_progress: float
    staging_started_at: float | None
    lease_expires_at: float
    # Shown by the dashboard only; the router never reads them.
    accelerator: str = "cpu"
    labels: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    last_error: str | None = None
    engine_kind: str = "sglang"
    # When the engine first registered from its URL (kept while it registers again from
    # it): fetch plans place engines that came after a version's publication by it.
    registered_at: float = 0.0
    # The hash of the token that registered it (None: an admin's); only that token (or an
    # admin) renews its lease. Heartbeats read it to answer before their commit.
    owner: str | None = field(default=None, repr=False)

    @property
    def serving(self) -> bool:
        return self.sync_state in SERVING_STATES and self.applied_version is not None


@dataclass(frozen=True)
class RunView:
    run_id: str
    latest_version: int | None
    latest_published_at: float | None
    policy: TargetPolicy
    store_url: str = ""
    boot_version: int = 0


@dataclass
class Group:
    """Serving engines of one (run, precision), sorted by applied version."""

    engines: list[EngineView]
    versions: list[int]
    seeds: np.ndarray

    def span(self, constraint: VersionConstraint) -> tuple[int, int]:
        """Index range [lo, hi) of the engines whose version satisfies `constraint`."""
        if constraint.exact_version is not None:
            v = constraint.exact_version
            return bisect_left(self.versions, v), bisect_right(self.versions, v)
        if constraint.min_version is not None:
            return bisect_left(self.versions, constraint.min_version), len(self.versions)
        return 0, len(self.versions)


def engine_seed(engine_id: str) -> int:
    return xxhash.xxh64_intdigest(engine_id.encode())


# When each (run, version) was published, recorded by every snapshot built while it was
# the run's newest version (the database keeps only the latest one's time in a run's
# view). Fetch plans order the engines registered after a version by registration; every
# replica builds a snapshot every `snapshot_refresh_s` (0.5 s), so all of them learn each
# version's time, whoever asks them for plans, unless it is replaced within one refresh.
_PUBLISHED: dict[tuple[str, int], float] = {}
_PUBLISHED_KEPT = 4096


def _remember_published(runs: Iterable[RunView]) -> None:
    for run in runs:
        if run.latest_version is None or run.latest_published_at is None:
            continue
        key = (run.run_id, run.latest_version)
        if key not in _PUBLISHED:
            if len(_PUBLISHED) >= _PUBLISHED_KEPT:
                _PUBLISHED.pop(next(iter(_PUBLISHED)))
            _PUBLISHED[key] = run.latest_published_at


def published_at(run_id: str, version: int) -> float | None:
    """When `version` of `run_id` was published, if a snapshot of this process showed it
    as the run's newest version; None otherwise."""
    return _PUBLISHED.get((run_id, version))


@dataclass
class FleetSnapshot:
    built_at: float
    engines: dict[str, EngineView]
    runs: dict[str, RunView]
    groups: dict[tuple[str, Precision], Group]
    targets: dict[str, int | None]
    demand: dict[str, dict[int, float]] = field(default_factory=dict)
    # The versions the store still holds, for the runs whose policy pins old versions
    # (absent: not listed, e.g. follow_latest runs or an unreadable store).
    available: dict[str, frozenset[int]] = field(default_factory=dict)
    # When the engines' rows were read from the database: `built_at` for a snapshot read
    # whole, the read it was patched from for one `patched` with this process's heartbeats
    # (whose other engines, and the other replicas' writes, are only as fresh as that read).
    read_at: float = 0.0

    @classmethod
    def empty(cls) -> FleetSnapshot:
        return cls(0.0, {}, {}, {}, {})

    @classmethod
    def build(
        cls,
        now: float,
        engines: Iterable[EngineView],
        runs: Iterable[RunView],
        demand: Mapping[str, Mapping[int, float]],
        available: Mapping[str, frozenset[int]] | None = None,
    ) -> FleetSnapshot:
        by_id = {e.engine_id: e for e in engines if e.lease_expires_at > now}
        run_map = {r.run_id: r for r in runs}
        _remember_published(run_map.values())
        grouped: dict[tuple[str, Precision], list[EngineView]] = {}
        per_run: dict[str, list[EngineView]] = {}
        for e in by_id.values():
            per_run.setdefault(e.run_id, []).append(e)
            if e.serving:
                grouped.setdefault((e.run_id, e.precision), []).append(e)
        groups = {}
        for key, members in grouped.items():
            members.sort(key=lambda e: (e.applied_version, e.engine_id))
            groups[key] = Group(
                engines=members,
                versions=[e.applied_version for e in members],  # type: ignore[misc]
                seeds=np.array([engine_seed(e.engine_id) for e in members], dtype=np.uint64),
            )
        available = dict(available or {})
        targets: dict[str, int | None] = {}
        for run_id, members in per_run.items():
            run = run_map.get(run_id)
            if run is None:
                targets.update({e.engine_id: None for e in members})
                continue
            if not active_pins(
                run.policy, run.latest_version, demand.get(run_id, {}), now, available.get(run_id)
            ):
                # What `assign_targets` answers without pins, without a PolicyEngine per
                # engine (most of a rebuild's own time at 1,000 engines).
                targets.update(dict.fromkeys((e.engine_id for e in members), run.latest_version))
                continue
            targets.update(
                assign_targets(
                    run.policy,
                    run.latest_version,
                    (
                        PolicyEngine(
                            e.engine_id,
                            e.applied_version,
                            e.sync_state not in (SyncState.ERROR, SyncState.DRAINING),
                        )
                        for e in members
                    ),
                    demand.get(run_id, {}),
                    now,
                    available.get(run_id),
                )
            )
        return cls(
            now,
            by_id,
            run_map,
            groups,
            targets,
            {k: dict(v) for k, v in demand.items()},
            available,
            read_at=now,
        )

    def patched(self, now: float, views: Iterable[EngineView]) -> FleetSnapshot:
        """This snapshot with `views` in place of the engines of the same id (engines it
        does not list are left out: only a read adds engines), indices and targets rebuilt,
        and leases lapsed by `now` left out, as a read at `now` would. Keeps `read_at`."""
        engines = dict(self.engines)
        for view in views:
            if view.engine_id in engines:
                engines[view.engine_id] = view
        snap = FleetSnapshot.build(
            now, engines.values(), self.runs.values(), self.demand, self.available
        )
        snap.read_at = self.read_at
        return snap

    def run_engines(self, run_id: str) -> list[EngineView]:
        return [e for e in self.engines.values() if e.run_id == run_id]

    def target_for(self, engine_id: str, run_id: str) -> int | None:
        if engine_id in self.targets:
            return self.targets[engine_id]
        run = self.runs.get(run_id)
        return run.latest_version if run else None
