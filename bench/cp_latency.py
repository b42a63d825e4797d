"""The control plane's own side of the engines' latencies, read from its `/metrics`.

Owns scraping the control plane's latency histograms (`tether_heartbeat_seconds`: a
heartbeat's time in its handler; `tether_heartbeat_commit_seconds`: until its lease renewal
committed, which a beat answered before its commit does not wait for;
`tether_target_wake_seconds`: a version's publication, or
the long-poll's arrival if later, until a long-poll answered it), taking the difference of
two scrapes (one measurement window) and reading quantiles from the buckets the way
Prometheus' `histogram_quantile` does (linear within a bucket), and reading a counter
(`counter`, or per label value `counter_by`: the store bytes the control plane read, which
count in the store's egress, or how often it read its fleet snapshot from the database and
how often it patched it).
Beside the swarm's own client-side figures these say which side was slow. Never asserts;
never used outside `bench/`.
"""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = (
    "tether_heartbeat_seconds",
    "tether_heartbeat_commit_seconds",
    "tether_target_wake_seconds",
    "tether_gc_pause_seconds",
)

# name → [(upper bound, cumulative count)], the +Inf bucket last.
Buckets = dict[str, list[tuple[float, float]]]


def scrape(url: str, names: tuple[str, ...] = HISTOGRAMS) -> Buckets:
    """The cumulative buckets of `names` at the control plane at `url` now."""
    reply = httpx.get(f"{url}/metrics", timeout=30.0)
    reply.raise_for_status()
    found: Buckets = {name: [] for name in names}
    for family in text_string_to_metric_families(reply.text):
        if family.name not in found:
            continue
        for sample in family.samples:
            if sample.name == f"{family.name}_bucket":
                found[family.name].append((float(sample.labels["le"]), sample.value))
    for buckets in found.values():
        buckets.sort()
    return found


def _counter_samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of the counter `name` at the control plane at `url`
    now, from one scrape."""
    reply = httpx.get(f"{url}/metrics", timeout=30.0)
    reply.raise_for_status()
    family_name = name.removesuffix("_total")
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(reply.text)
        if family.name == family_name
        for sample in family.samples
        if sample.name == f"{family_name}_total"
    ]


def counter(url: str, name: str) -> float:
    """The sum over labels of the counter `name` at the control plane at `url` now (0 when
    it has none yet)."""
    return sum(value for _labels, value in _counter_samples(url, name))


def counter_by(url: str, name: str, label: str) -> dict[str, float]:
    """The counter `name` at the control plane at `url` now, summed per value of its label
    `label` (a value never counted is absent)."""
    found: dict[str, float] = {}
    for labels, value in _counter_samples(url, name):
        found[labels[label]] = found.get(labels[label], 0.0) + value
    return found


def window(before: Buckets, after: Buckets) -> Buckets:
    """What was observed between two scrapes."""
    out: Buckets = {}
    for name, late in after.items():
        early = dict(before.get(name, []))
        out[name] = [(le, count - early.get(le, 0.0)) for le, count in late]
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The `q` quantile of a cumulative histogram, linear within its bucket (None when
    empty; the largest finite bound when it falls in the +Inf bucket)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def count(buckets: list[tuple[float, float]]) -> int:
    return int(buckets[-1][1]) if buckets else 0


def above(buckets: list[tuple[float, float]], bound: float) -> int:
    """How many observations exceeded `bound` (one of the histogram's bucket bounds)."""
    within = next((n for le, n in buckets if le == bound), None)
    if within is None:
        raise ValueError(f"{bound} is not a bucket bound of this histogram")
    return count(buckets) - int(within)
