"""Prometheus metrics of one engine agent, read from its `AgentStatus` at scrape time.

Owns the metric names of the agent's `/metrics`: the applied version, whether the agent is
healthy, and failed reconcile passes by error type (a full staging disk counts under
`StageFailed`). Must never do I/O or change the status it reads.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine_agent.status import AgentStatus


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


def render(status: AgentStatus) -> bytes:
    """The Prometheus text exposition of `status`."""
    registry = CollectorRegistry()
    registry.register(_StatusCollector(status))
    return generate_latest(registry)
