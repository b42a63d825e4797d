"""Prometheus metrics of one engine agent, read from its `AgentStatus` at scrape time.

Owns the metric names of the agent's `/metrics`: the applied version, whether the agent is
healthy, failed reconcile passes by error type (a full staging disk counts under
`StageFailed`), peer-assisted fetch (bytes by source, dropped sources, uploads), how long
each cycle collection held the process (`GC_PAUSES`, one per process, as the collector is),
and how long warming the codecs and the converters took at boot. Must never do I/O or
change the status it reads.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine_agent.status import AgentStatus
from runtime.collector import PauseObserver
from runtime.loop_metrics import LoopHistogram

# Observed inside the cycle collector (lock-free); `GC_OBSERVER.install()` once booted.
GC_PAUSES = LoopHistogram(
    "tether_agent_gc_pause_seconds",
    "Seconds each cycle collection of this process held it (the proxy, heartbeats and "
    "peer uploads wait through it)",
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
)
GC_OBSERVER = PauseObserver(GC_PAUSES.observe)


class _StatusCollector:
    def __init__(self, status: AgentStatus) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        status = self.status
        applied = GaugeMetricFamily(
            "tether_agent_applied_version", "Version the engine serves (-1: unknown)"
        )
        applied.add_metric([], -1 if status.applied_version is None else status.applied_version)
        yield applied
        healthy = GaugeMetricFamily(
            "tether_agent_healthy", "1 while the agent is in routing (ready or syncing)"
        )
        healthy.add_metric([], 1 if status.healthy else 0)
        yield healthy
        failures = CounterMetricFamily(
            "tether_agent_reconcile_failures",
            "Reconcile passes that failed and were retried, by error type",
            labels=["error"],
        )
        for error, count in sorted(status.failures.items()):
            failures.add_metric([error], count)
        yield failures
        yield from _peer_metrics(status)
        yield from GC_PAUSES.collect()
        for name, help_text, value in (
            (
                "tether_agent_gc_frozen_objects",
                "Objects the cycle collector never scans: what existed once the agent booted "
                "(0: gc_settle off)",
                gc.get_freeze_count(),
            ),
            (
                "tether_agent_codecs_warm_seconds",
                "Seconds loading the codecs' imports and kernels took at boot, before "
                "serving (0: not warmed; the first catch-up paid it)",
                status.codecs_warmed_s or 0.0,
            ),
            (
                "tether_agent_conversion_warm_seconds",
                "Seconds loading the engine precision's conversion kernels took at boot (0: "
                "bf16, or not warmed; the first conversion paid it)",
                status.conversion_warmed_s or 0.0,
            ),
        ):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], value)
            yield gauge


def _peer_metrics(status: AgentStatus) -> Iterator[Metric]:
    """Peer-assisted fetch (docs/peers.md): where version bytes came from, dropped sources,
    and what this agent uploaded to its peers."""
    yield _counter(
        "tether_agent_fetched_bytes",
        "Version-file bytes fetched, by source (store, peer, http, objects)",
        "source",
        status.fetched_bytes,
    )
    yield _counter(
        "tether_agent_fetch_source_faults",
        "Fetch sources dropped for bad bytes, failures or stalls, by reason",
        "reason",
        status.source_faults,
    )
    yield _counter(
        "tether_agent_fetch_rejected_bytes",
        "Bytes received from a fetch source and discarded: they did not match the store",
        None,
        {"": status.rejected_bytes},
    )
    yield _counter(
        "tether_agent_peer_served_bytes",
        "Version-file bytes served to peers",
        None,
        {"": status.served_bytes},
    )


def _counter(name: str, doc: str, label: str | None, counts: Mapping[str, int]) -> Metric:
    """A counter family from `counts` (label value -> count; one unlabelled sample when
    `label` is None)."""
    family = CounterMetricFamily(name, doc, labels=[label] if label else None)
    for value, count in sorted(counts.items()):
        family.add_metric([value] if label else [], count)
    return family


def render(status: AgentStatus) -> bytes:
    """The Prometheus text exposition of `status`."""
    registry = CollectorRegistry()
    registry.register(_StatusCollector(status))
    return generate_latest(registry)
