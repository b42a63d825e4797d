"""The request path's loop tallies export exactly what prometheus_client's own counter and
histogram would for the same events (less the `_created` timestamps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from runtime.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4)


def _samples(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line and "_created" not in line]


def test_loop_histogram_counts_bounds_and_sum_as_prometheus_client_does() -> None:
    # On a bound, between bounds, below the first and above the last.
    values = [5e-6, 1e-6, 7e-6, 1e-5, 3e-5, 1e-4, 2.5, 0.0]
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("decide_seconds", "help", buckets=BUCKETS, registry=theirs)
    tally = LoopHistogram("decide_seconds", "help", buckets=BUCKETS)
    ours.register(tally)
    for value in values:
        reference.observe(value)
        tally.observe(value)
    assert _samples(ours) == _samples(theirs)
    assert 'decide_seconds_bucket{le="5e-06"} 3.0' in _samples(ours)


def test_loop_counter_exports_one_sample_per_label_values_as_prometheus_client_does() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("asked_total", "help", ["route", "status"], registry=theirs)
    tally = LoopCounter("asked_total", "help", ["route", "status"])
    ours.register(tally)
    for route, status in [("/a", 200), ("/a", 200), ("/b", 409), ("/a", 503)]:
        reference.labels(route, str(status)).inc()
        tally.counts[(route, status)] += 1
    assert sorted(_samples(ours)) == sorted(_samples(theirs))
    assert 'asked_total{route="/a",status="200"} 2.0' in _samples(ours)
