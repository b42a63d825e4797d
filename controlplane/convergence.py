"""How fast each published version spreads through the fleet, read from snapshot to snapshot.

Owns the per-version convergence record: seconds from publication until 50, 90, 99 and
100 % of a run's serving capacity (engines weighted by their capacity) serves the version
or a newer one, for the whole run and for each precision class; the bytes engines report
having read to reach it, from the store and from peers (heartbeat `fetched`, summed per
engine, the latest report of each engine counting once); the transitions between two
snapshots that matter to an operator (a lease that lapsed instead of a deregistration, an
engine entering `error`); and the Prometheus series for all of them. It compares snapshots
the fleet already built and adds a dictionary update per heartbeat that carries a fetch
report: it never reads the database. Each control-plane replica keeps its own record; a
replica that starts after a version was published reports that version's times as upper
bounds, and the byte counts of the heartbeats it received.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controlplane.snapshot import EngineView, FleetSnapshot
from wire import FetchReport, SyncState

#: The fractions of serving capacity whose crossing times are recorded.
THRESHOLDS = (0.5, 0.9, 0.99, 1.0)
#: Versions remembered per run (the dashboard's timeline).
VERSIONS_KEPT = 32
#: Buckets of the crossing-time histogram (seconds).
REACHED_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


def _key(threshold: float) -> str:
    """`t50_s`, `t90_s`, `t99_s`, `t100_s`."""
    return f"t{round(threshold * 100)}_s"


@dataclass
class Spread:
    """How far one version got in one group of engines: crossing times and bytes read."""

    # threshold → seconds after publication; absent until crossed.
    reached: dict[float, float] = field(default_factory=dict)
    serving_fraction: float = 0.0
    capacity: int = 0
    # engine id → (store bytes, peer bytes) of its catch-up to this version.
    fetched: dict[str, tuple[int, int]] = field(default_factory=dict)

    def advance(self, serving: list[EngineView], version: int, elapsed: float) -> list[float]:
        """Update from the serving engines of the group; return the thresholds crossed now."""
        self.capacity = sum(e.capacity for e in serving)
        if not self.capacity:
            self.serving_fraction = 0.0
            return []
        on = sum(e.capacity for e in serving if (e.applied_version or 0) >= version)
        self.serving_fraction = on / self.capacity
        crossed = []
        for threshold in THRESHOLDS:
            if threshold not in self.reached and self.serving_fraction >= threshold - 1e-12:
                self.reached[threshold] = max(0.0, elapsed)
                crossed.append(threshold)
        return crossed

    @property
    def store_bytes(self) -> int:
        return sum(s for s, _ in self.fetched.values())

    @property
    def peer_bytes(self) -> int:
        return sum(p for _, p in self.fetched.values())

    def times(self) -> dict[str, float | None]:
        return {_key(t): self.reached.get(t) for t in THRESHOLDS}


@dataclass
class VersionSpread:
    """One version of one run: when it was published and how far it got, overall (the
    fields below) and per precision class (`precisions`)."""

    version: int
    published_at: float
    # threshold → seconds after publication, over all the run's serving capacity.
    reached: dict[float, float] = field(default_factory=dict)
    serving_fraction: float = 0.0
    # True when it had already crossed some thresholds when this process first saw it.
    upper_bound: bool = False
    precisions: dict[str, Spread] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "published_at": self.published_at,
            "serving_fraction": self.serving_fraction,
            **{_key(t): self.reached.get(t) for t in THRESHOLDS},
            "upper_bound": self.upper_bound,
        }

    @property
    def converged(self) -> bool:
        return len(self.reached) == len(THRESHOLDS) and all(
            len(s.reached) == len(THRESHOLDS) for s in self.precisions.values()
        )


class Convergence:
    """Fed every new fleet snapshot (`observe`); answers each run's version timeline."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.timelines: dict[str, deque[VersionSpread]] = {}
        self._previous: dict[str, EngineView] = {}
        self._seen_any = False
        # run → the (precision, source) label pairs of `latest_fetched` set so far.
        self._exported: dict[str, set[tuple[str, str]]] = {}
        self.unconverged = Gauge(
            "tether_version_unconverged_seconds",
            "Seconds the run's latest version has been published without every serving "
            "engine serving it (0 once converged)",
            ["run"],
            registry=registry,
        )
        self.lease_lapses = Counter(
            "tether_engine_lease_lapses_total",
            "Engines that left the fleet because their lease lapsed (not a deregistration)",
            ["run", "precision"],
            registry=registry,
        )
        self.engine_errors = Counter(
            "tether_engine_errors_total",
            "Engines that entered the error state (a failed stage or commit), by precision",
            ["run", "precision"],
            registry=registry,
        )
        self.reached = Histogram(
            "tether_version_reached_seconds",
            "Seconds from a version's publication until `fraction` of the run's serving "
            "capacity of a precision served it or a newer one",
            ["run", "precision", "fraction"],
            buckets=REACHED_BUCKETS,
            registry=registry,
        )
        self.fetched_total = Counter(
            "tether_version_fetched_bytes_total",
            "Bytes engines reported reading to catch up, by source (store or peer)",
            ["run", "precision", "source"],
            registry=registry,
        )
        self.latest_fetched = Gauge(
            "tether_latest_version_fetched_bytes",
            "Bytes engines reported reading to reach the run's latest version, by source",
            ["run", "precision", "source"],
            registry=registry,
        )

    def observe(self, snap: FleetSnapshot) -> None:
        self._transitions(snap)
        by_run: dict[str, list[EngineView]] = {}
        for e in snap.engines.values():
            if e.serving:
                by_run.setdefault(e.run_id, []).append(e)
        for run in snap.runs.values():
            timeline = self.timelines.setdefault(run.run_id, deque(maxlen=VERSIONS_KEPT))
            latest = run.latest_version
            if latest is not None and (not timeline or timeline[-1].version < latest):
                published = run.latest_published_at or snap.built_at
                timeline.append(VersionSpread(latest, published, upper_bound=not self._seen_any))
                self._export_fetched(run.run_id, timeline[-1])
            serving = by_run.get(run.run_id, [])
            for spread in timeline:
                if not spread.converged:
                    self._advance(run.run_id, spread, serving, snap.built_at)
            head = timeline[-1] if timeline else None
            self.unconverged.labels(run.run_id).set(
                0.0
                if head is None or 1.0 in head.reached
                else max(0.0, snap.built_at - head.published_at)
            )
        self._seen_any = True

    def _advance(
        self, run_id: str, spread: VersionSpread, serving: list[EngineView], now: float
    ) -> None:
        elapsed = now - spread.published_at
        overall = Spread(reached=spread.reached)
        overall.advance(serving, spread.version, elapsed)
        spread.serving_fraction = overall.serving_fraction
        by_precision: dict[str, list[EngineView]] = {}
        for e in serving:
            by_precision.setdefault(e.precision.value, []).append(e)
        for precision, members in by_precision.items():
            group = spread.precisions.setdefault(precision, Spread())
            for threshold in group.advance(members, spread.version, elapsed):
                if not spread.upper_bound:
                    self.reached.labels(run_id, precision, str(threshold)).observe(
                        group.reached[threshold]
                    )

    def note_fetch(self, engine: EngineView, report: FetchReport) -> None:
        """An engine's heartbeat says what its catch-up to `report.version` read."""
        timeline = self.timelines.get(engine.run_id)
        if timeline is None:
            return
        spread = next((s for s in reversed(timeline) if s.version == report.version), None)
        if spread is None:
            return
        group = spread.precisions.setdefault(engine.precision.value, Spread())
        before = group.fetched.get(engine.engine_id, (0, 0))
        now = (report.store_bytes, report.peer_bytes)
        if now == before:
            return
        group.fetched[engine.engine_id] = now
        for source, old, new in (("store", before[0], now[0]), ("peer", before[1], now[1])):
            if new > old:
                self.fetched_total.labels(engine.run_id, engine.precision.value, source).inc(
                    new - old
                )
        if spread is timeline[-1]:
            self._export_fetched(engine.run_id, spread)

    def _export_fetched(self, run_id: str, spread: VersionSpread) -> None:
        """The latest version's bytes by precision and source, as gauges (those of an
        earlier version go back to 0 when a new one begins)."""
        exported = self._exported.setdefault(run_id, set())
        for precision, source in exported:
            self.latest_fetched.labels(run_id, precision, source).set(0)
        for precision, group in spread.precisions.items():
            for source, value in (("store", group.store_bytes), ("peer", group.peer_bytes)):
                self.latest_fetched.labels(run_id, precision, source).set(value)
                exported.add((precision, source))

    def spread(self, run_id: str, version: int) -> VersionSpread | None:
        """The record of `version` of `run_id`, if this replica still keeps it."""
        for spread in self.timelines.get(run_id, ()):
            if spread.version == version:
                return spread
        return None

    def _transitions(self, snap: FleetSnapshot) -> None:
        now = snap.built_at
        for engine_id, before in self._previous.items():
            after = snap.engines.get(engine_id)
            if after is None:
                # Gone: a lapsed lease if it expired by now, else it deregistered.
                if before.lease_expires_at <= now:
                    self.lease_lapses.labels(before.run_id, before.precision.value).inc()
            elif after.sync_state is SyncState.ERROR and before.sync_state is not SyncState.ERROR:
                self.engine_errors.labels(after.run_id, after.precision.value).inc()
        for engine_id, after in snap.engines.items():
            if (
                engine_id not in self._previous
                and self._seen_any
                and after.sync_state is SyncState.ERROR
            ):
                self.engine_errors.labels(after.run_id, after.precision.value).inc()
        self._previous = dict(snap.engines)

    def timeline(self, run_id: str) -> list[dict[str, Any]]:
        return [s.as_dict() for s in self.timelines.get(run_id, ())]
