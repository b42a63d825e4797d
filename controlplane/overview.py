"""The fleet overview: one JSON document with everything the dashboard and `tether fleet` show.

Owns the overview's content and its cache: engine rows and per-precision summaries taken
from the current fleet snapshot, each run's version timeline (`convergence.py`), the
request rates of this process (409s, engine retries, requests) sampled at each snapshot
swap, and the sampler gap and rollout staleness the trainer reports per step (kept in
memory, the last `GAP_STEPS_KEPT` steps per run). The document is encoded at most once per
snapshot or report, never per request, and building it never touches the database, the
request path or the heartbeat lane. Gap reports live in the replica that received them: a
dashboard behind several replicas shows the gap of the replica it asks.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.convergence import Convergence
from controlplane.metrics import Metrics
from controlplane.snapshot import FleetSnapshot
from runtime.loop_metrics import LoopCounter
from wire import GapReport as GapReportBody
from wire import Precision, SyncState

#: Training steps of gap reports kept per run.
GAP_STEPS_KEPT = 200
#: The window the request rates are averaged over.
RATE_WINDOW_S = 60.0


def _counter_total(counter: Counter | LoopCounter) -> dict[str, float]:
    """A labelled counter's totals by its first label (e.g. the 409 reason)."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = next(iter(sample.labels.values()), "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


class RequestRates:
    """Per-second rates of this process's 409s, engine retries and requests over the last
    `RATE_WINDOW_S` seconds, from counter totals sampled at each snapshot swap."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.samples: deque[tuple[float, dict[str, dict[str, float]]]] = deque()

    def sample(self, now: float) -> None:
        self.samples.append(
            (
                now,
                {
                    "not_ready": _counter_total(self.metrics.not_ready),
                    "retries": _counter_total(self.metrics.engine_retries),
                    "requests": {"all": sum(_counter_total(self.metrics.requests).values())},
                },
            )
        )
        while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_WINDOW_S:
            self.samples.popleft()

    def rates(self) -> dict[str, Any]:
        if len(self.samples) < 2:
            zero = {"not_ready_per_s": 0.0, "retries_per_s": 0.0, "requests_per_s": 0.0}
            return {"window_s": 0.0, **zero, "not_ready_by_reason": {}, "retries_by_reason": {}}
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        span = max(t1 - t0, 1e-9)

        def per_s(kind: str) -> dict[str, float]:
            return {
                k: (v - first[kind].get(k, 0.0)) / span
                for k, v in last[kind].items()
                if v - first[kind].get(k, 0.0) > 0
            }

        not_ready, retries = per_s("not_ready"), per_s("retries")
        return {
            "window_s": span,
            "not_ready_per_s": sum(not_ready.values()),
            "retries_per_s": sum(retries.values()),
            "requests_per_s": sum(per_s("requests").values()),
            "not_ready_by_reason": not_ready,
            "retries_by_reason": retries,
        }


@dataclass(frozen=True)
class GapEntry:
    reported_at: float
    report: GapReportBody

    def as_dict(self) -> dict[str, Any]:
        return {"reported_at": self.reported_at, **self.report.model_dump(mode="json")}


class GapLog:
    """The trainer's gap reports per run, newest last, and their Prometheus gauges."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.runs: dict[str, deque[GapEntry]] = {}
        self.generation = 0
        self.k3 = Gauge(
            "tether_sampler_gap_k3",
            "k3 estimate of KL(sampler ‖ trainer) over the last reported step, by precision",
            ["run", "precision"],
            registry=registry,
        )
        self.abs_diff = Gauge(
            "tether_sampler_gap_logprob_abs_diff",
            "Mean |log p_trainer − log q_sampler| over the last reported step, by precision",
            ["run", "precision"],
            registry=registry,
        )
        self.masked = Gauge(
            "tether_sampler_gap_masked_fraction",
            "Fraction of tokens outside the MIS band in the last reported step, by precision",
            ["run", "precision"],
            registry=registry,
        )
        self.staleness = Gauge(
            "tether_rollout_staleness_versions",
            "Versions between the trainer and the rollouts it learned from in the last step",
            ["run", "stat"],
            registry=registry,
        )
        self.reports = Counter(
            "tether_trainer_gap_reports_total",
            "Gap reports received from trainers",
            ["run"],
            registry=registry,
        )

    def add(self, run_id: str, report: GapReportBody, now: float) -> int:
        log = self.runs.setdefault(run_id, deque(maxlen=GAP_STEPS_KEPT))
        log.append(GapEntry(now, report))
        self.generation += 1
        self.reports.labels(run_id).inc()
        for precision, gap in report.precisions.items():
            self.k3.labels(run_id, precision.value).set(gap.k3_kl)
            if gap.logprob_abs_diff is not None:
                self.abs_diff.labels(run_id, precision.value).set(gap.logprob_abs_diff)
            if gap.masked_fraction is not None:
                self.masked.labels(run_id, precision.value).set(gap.masked_fraction)
        if report.staleness_mean is not None:
            self.staleness.labels(run_id, "mean").set(report.staleness_mean)
        if report.staleness_max is not None:
            self.staleness.labels(run_id, "max").set(report.staleness_max)
        return len(log)

    def entries(self, run_id: str) -> list[dict[str, Any]]:
        return [e.as_dict() for e in self.runs.get(run_id, ())]


def build_overview(
    snap: FleetSnapshot,
    convergence: Convergence,
    gaps: GapLog,
    rates: dict[str, Any],
    lease_seconds: float,
) -> dict[str, Any]:
    """The overview document of `snap` (plain dicts, ready to encode)."""
    now = snap.built_at
    engines = []
    summary: dict[tuple[str, str], dict[str, Any]] = {}
    versions: dict[tuple[str, str], Tally[int | None]] = {}
    for e in sorted(snap.engines.values(), key=lambda e: (e.run_id, e.precision, e.engine_id)):
        precision, state = e.precision.value, e.sync_state.value
        run = snap.runs.get(e.run_id)
        latest = run.latest_version if run is not None else None
        lag = None
        if latest is not None and e.applied_version is not None:
            lag = latest - e.applied_version
        engines.append(
            {
                "engine_id": e.engine_id,
                "run_id": e.run_id,
                "url": e.url,
                "precision": precision,
                "accelerator": e.accelerator,
                "kind": e.engine_kind,
                "labels": dict(e.labels),
                "capacity": e.capacity,
                "applied_version": e.applied_version,
                "target_version": snap.target_for(e.engine_id, e.run_id),
                "lag": lag,
                "sync_state": state,
                "staging_target": e.staging_target,
                "staging_progress": e.staging_progress,
                "in_flight": e.in_flight,
                "heartbeat_age_s": max(0.0, now - (e.lease_expires_at - lease_seconds)),
                "lease_left_s": e.lease_expires_at - now,
                "last_error": e.last_error,
            }
        )
        key = (e.run_id, precision)
        row = summary.get(key)
        if row is None:
            row = summary[key] = {
                "run_id": e.run_id, "precision": precision, "engines": 0, "serving": 0,
                "capacity": 0, "in_flight": 0, "states": {}, "lag_max": None, "lag_sum": 0,
                "lag_n": 0,
            }  # fmt: skip
            versions[key] = Tally()
        row["engines"] += 1
        row["serving"] += e.serving
        row["capacity"] += e.capacity
        row["in_flight"] += e.in_flight
        row["states"][state] = row["states"].get(state, 0) + 1
        if lag is not None:
            row["lag_max"] = lag if row["lag_max"] is None else max(row["lag_max"], lag)
            row["lag_sum"] += lag
            row["lag_n"] += 1
        versions[key][e.applied_version] += 1
    precisions = []
    for key, row in sorted(summary.items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))):
        n = row.pop("lag_n")
        total = row.pop("lag_sum")
        row["lag_mean"] = total / n if n else None
        row["versions"] = {
            "none" if v is None else str(v): c
            for v, c in sorted(versions[key].items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        }
        precisions.append(row)
    runs = []
    for run in sorted(snap.runs.values(), key=lambda r: r.run_id):
        gap = gaps.entries(run.run_id)
        runs.append(
            {
                "run_id": run.run_id,
                "latest_version": run.latest_version,
                "latest_published_at": run.latest_published_at,
                "policy": run.policy.kind.value,
                "timeline": convergence.timeline(run.run_id),
                "gap": gap,
            }
        )
    return {
        "built_at": now,
        "lease_seconds": lease_seconds,
        "engines": engines,
        "precisions": precisions,
        "runs": runs,
        "rates": rates,
        "states": [s.value for s in SyncState],
    }


def _order(precision: str) -> int:
    names = [p.value for p in Precision]
    return names.index(precision) if precision in names else len(names)


class Overview:
    """Observes snapshots; answers the encoded overview, rebuilt at most once per change."""

    def __init__(self, metrics: Metrics, lease_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self.convergence = Convergence(metrics.registry)
        self.gaps = GapLog(metrics.registry)
        self.rates = RequestRates(metrics)
        self._snap: FleetSnapshot | None = None
        self._seen = 0
        self._cache: tuple[int, int, bytes] | None = None

    def observe(self, snap: FleetSnapshot) -> None:
        self._snap = snap
        self._seen += 1
        self.convergence.observe(snap)
        self.rates.sample(snap.built_at)

    def report_gap(self, run_id: str, report: GapReportBody) -> int:
        return self.gaps.add(run_id, report, time.time())

    def encoded(self) -> bytes:
        """The overview of the latest observed snapshot, as JSON bytes."""
        snap = self._snap or FleetSnapshot.empty()
        key = (self._seen, self.gaps.generation)
        if self._cache is None or self._cache[:2] != key:
            doc = build_overview(
                snap, self.convergence, self.gaps, self.rates.rates(), self.lease_seconds
            )
            self._cache = (*key, orjson.dumps(doc))
        return self._cache[2]
