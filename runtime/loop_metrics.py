"""Metrics tallied by the event loop's thread, exported at scrape time.

A prometheus_client counter's `inc` and a histogram's `observe` take a lock and several
Python calls each (about 2 and 5 µs on the 2-core bench machine, a tenth of the router's
Python per request between them). The figures a hot path adds to are plain tallies
instead, added to by one thread only (the event loop's, or the cycle collector's
callback, which runs in whichever thread it interrupts while holding the GIL, so it must
not take a lock) and turned into the same metric families when scraped. A scrape from
another thread may read a figure one observation behind, never a torn one that stays
wrong.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Hashable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# prometheus_client's bound formatting (untyped there), so the text matches its histograms.
_go_float: Callable[[float], str] = floatToGoString


class LoopCounter:
    """A labelled counter of the event loop's thread, exported at scrape time. `counts` is
    keyed by the label values (anything `str()` turns into the label, e.g. a status code)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.counts: Tally[tuple[Hashable, ...]] = Tally()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, n in list(self.counts.items()):
            family.add_metric([str(value) for value in labels], n)
        yield family


class LoopHistogram:
    """An unlabelled histogram of the event loop's thread, exported at scrape time, with
    prometheus_client's bucket rule (a value counts in every bucket whose bound is >= it)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self.counts), self.sum
        buckets, cumulative = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            cumulative += n
            buckets.append((_go_float(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)
