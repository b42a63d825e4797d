"""How fast each published version spreads through the fleet, read from snapshot to snapshot.

Owns the per-version convergence record (seconds from publication until 50 %, 90 % and
100 % of a run's serving engines serve the version or a newer one), the transitions between
two snapshots that matter to an operator (a lease that lapsed instead of a deregistration,
an engine entering `error`), and the Prometheus series for both. It only compares
snapshots the fleet already built: it never reads the database and adds nothing to the
request or heartbeat paths. Each control-plane replica keeps its own record; a replica
that starts after a version was published reports that version's times as upper bounds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.snapshot import EngineView, FleetSnapshot
from wire import SyncState

#: The fractions of serving engines whose crossing times are recorded.
THRESHOLDS = (0.5, 0.9, 1.0)
#: Versions remembered per run (the dashboard's timeline).
VERSIONS_KEPT = 32


@dataclass
class VersionSpread:
    """One version of one run: when it was published and when it reached each threshold."""

    version: int
    published_at: float
    # threshold → seconds after publication; absent until crossed.
    reached: dict[float, float] = field(default_factory=dict)
    serving_fraction: float = 0.0
    # True when it had already crossed some thresholds when this process first saw it.
    upper_bound: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "published_at": self.published_at,
            "serving_fraction": self.serving_fraction,
            "t50_s": self.reached.get(0.5),
            "t90_s": self.reached.get(0.9),
            "t100_s": self.reached.get(1.0),
            "upper_bound": self.upper_bound,
        }


class Convergence:
    """Fed every new fleet snapshot (`observe`); answers each run's version timeline."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.timelines: dict[str, deque[VersionSpread]] = {}
        self._previous: dict[str, EngineView] = {}
        self._seen_any = False
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
            serving = by_run.get(run.run_id, [])
            for spread in timeline:
                if len(spread.reached) == len(THRESHOLDS):
                    continue
                self._advance(spread, serving, snap.built_at)
            head = timeline[-1] if timeline else None
            self.unconverged.labels(run.run_id).set(
                0.0
                if head is None or 1.0 in head.reached
                else max(0.0, snap.built_at - head.published_at)
            )
        self._seen_any = True

    @staticmethod
    def _advance(spread: VersionSpread, serving: list[EngineView], now: float) -> None:
        if not serving:
            spread.serving_fraction = 0.0
            return
        on = sum(1 for e in serving if (e.applied_version or 0) >= spread.version)
        spread.serving_fraction = on / len(serving)
        for threshold in THRESHOLDS:
            if threshold not in spread.reached and spread.serving_fraction >= threshold:
                spread.reached[threshold] = max(0.0, now - spread.published_at)

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
