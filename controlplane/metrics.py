"""Prometheus metrics of one control-plane process, in its own registry.

Owns metric names and the fleet gauges derived from a snapshot. Never blocks the request
path: counters and histograms are in-memory; fleet gauges are recomputed on refresh.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from controlplane.snapshot import FleetSnapshot
from controlplane.version_lag import VersionLag
from runtime.loop_metrics import LoopCounter, LoopHistogram

# Fine around the 50-ms heartbeat and 100-ms wake-up objectives and below a millisecond (a
# heartbeat answered before its commit), so the quantiles read from them are not mostly
# the linear guess within a wide bucket.
LATENCY_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # Added to on every request, so kept as loop tallies (see `LoopCounter`).
        self.requests = LoopCounter(
            "tether_requests_total",
            "HTTP requests by route template and status code",
            ["route", "status"],
        )
        self.registry.register(self.requests)
        self.not_ready = Counter(
            "tether_router_409_total",
            "409 WeightVersionNotReady answers by reason",
            ["reason"],
            registry=self.registry,
        )
        self.engine_retries = Counter(
            "tether_router_engine_retries_total",
            "Requests re-sent to another engine after a 409, 503 or connection failure",
            ["reason"],
            registry=self.registry,
        )
        self.peer_reports = Counter(
            "tether_peer_reports_total",
            "Peers reported by engines for bad bytes, failures or stalls, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.store_read_bytes = Counter(
            "tether_store_read_bytes_total",
            "Bytes this control plane read from object stores, by what for",
            ["what"],
            registry=self.registry,
        )
        self.fetch_plans = Counter(
            "tether_fetch_plans_total",
            "Fetch plans handed to catching-up engines, by whether they name peers",
            ["peers"],
            registry=self.registry,
        )
        self.fleet_snapshots = Counter(
            "tether_fleet_snapshots_total",
            "Fleet snapshots installed: read from the database whole (read), its rows "
            "written since the last read merged in (changed), or patched with this "
            "process's heartbeats (patch)",
            ["how"],
            registry=self.registry,
        )
        self.decision = LoopHistogram(
            "tether_routing_decision_seconds",
            "Time to choose an engine from the in-memory snapshot",
            buckets=(5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3),
        )
        self.registry.register(self.decision)
        self.engines = Gauge(
            "tether_engines",
            "Leased engines by state, precision and applied version",
            ["state", "precision", "version"],
            registry=self.registry,
        )
        self.at_latest = Gauge(
            "tether_fleet_capacity_at_latest_ratio",
            "Fraction of a run's serving capacity on its latest version",
            ["run"],
            registry=self.registry,
        )
        self.convergence = Histogram(
            "tether_version_convergence_seconds",
            "Seconds from a version's publication until every serving engine of the run applied it",
            ["run"],
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )
        self._converged: dict[str, int] = {}
        # The control plane's own side of the engines' latencies, so a slow client (a
        # starved agent) is never read as a slow control plane.
        self.heartbeat = Histogram(
            "tether_heartbeat_seconds",
            "Seconds from a heartbeat reaching its handler until its reply (its group commit "
            "included, unless it was answered before it)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.heartbeat_commit = Histogram(
            "tether_heartbeat_commit_seconds",
            "Seconds from a heartbeat reaching its handler until its lease renewal committed",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.heartbeats_answered_first = Counter(
            "tether_heartbeats_answered_first_total",
            "Heartbeats answered before their commit (the fleet snapshot showed the engine "
            "leased to the sender)",
            registry=self.registry,
        )
        # Observed inside the cycle collector (`runtime.collector`): lock-free.
        self.gc_pause = LoopHistogram(
            "tether_gc_pause_seconds",
            "Seconds each cycle collection of this process held it (every request waits)",
            buckets=(0.0001, *LATENCY_BUCKETS),
        )
        self.registry.register(self.gc_pause)
        self.target_wake = Histogram(
            "tether_target_wake_seconds",
            "Seconds from a version's publication (or the long-poll's arrival, if later) "
            "until a target long-poll answered it",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.sessions_created = Counter(
            "tether_sessions_created_total",
            "Agent sessions opened (POST /v1/sessions)",
            registry=self.registry,
        )
        self.session_turns = Counter(
            "tether_session_turns_total",
            "Agent-session turns answered, by placement: on the session's engine (stayed), "
            "on another one (moved), or the first engine it got (placed)",
            ["placement"],
            registry=self.registry,
        )
        # Exported at scrape time; the router adds one count per routed request.
        self.version_lag = VersionLag()
        self.registry.register(self.version_lag)

    def watch_in_flight(self, counts: Mapping[str, int]) -> None:
        """Export `counts` (requests this process is forwarding, by engine), read at scrape
        time, so the request path pays nothing for it."""
        self.registry.register(InFlight(counts))

    def observe_fleet(self, snap: FleetSnapshot) -> None:
        self.engines.clear()
        tally = Tally(
            (e.sync_state.value, e.precision.value, str(e.applied_version))
            for e in snap.engines.values()
        )
        for labels, n in tally.items():
            self.engines.labels(*labels).set(n)
        for run in snap.runs.values():
            serving = [e for e in snap.run_engines(run.run_id) if e.serving]
            capacity = sum(e.capacity for e in serving)
            on_latest = sum(e.capacity for e in serving if e.applied_version == run.latest_version)
            self.at_latest.labels(run.run_id).set(on_latest / capacity if capacity else 0.0)
            if (
                run.latest_version is not None
                and run.latest_published_at is not None
                and serving
                and on_latest == capacity
                and self._converged.get(run.run_id) != run.latest_version
            ):
                self._converged[run.run_id] = run.latest_version
                self.convergence.labels(run.run_id).observe(
                    max(0.0, snap.built_at - run.latest_published_at)
                )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class InFlight:
    """A scrape-time collector of this process's in-flight requests by engine."""

    def __init__(self, counts: Mapping[str, int]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tether_router_in_flight",
            "Requests this process is forwarding right now, by engine",
            labels=["engine"],
        )
        for engine_id, n in list(self.counts.items()):
            family.add_metric([engine_id], n)
        yield family
