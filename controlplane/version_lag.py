"""Request version lag: how many versions behind the run's latest each routed request ran.

Owns the tally the router adds to once per routed request (run, precision of the engine
picked, the run's latest version at that moment, the engine's applied version): a counter
increment in a dictionary, so the hot path pays well under a microsecond. Exported at
scrape time as the histogram `tether_request_version_lag` (cumulative, by run and
precision) and read per version by `GET /v1/runs/{run}/versions/{v}/convergence` (the
requests routed while that version was the latest; the last `VERSIONS_KEPT` versions of a
run are kept). In memory and per replica, as the rest of the convergence record. Never
decides a route.
"""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily, Metric

from controlplane.convergence import VERSIONS_KEPT
from controlplane.snapshot import EngineView, FleetSnapshot

#: Upper bounds (versions) of the exported histogram's buckets.
LAG_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32)


class VersionLag:
    """The tally, and the collector that exports it."""

    def __init__(self) -> None:
        # (run, latest version) → (precision, lag) → requests
        self._by_version: dict[tuple[str, int], Tally[tuple[str, int]]] = {}
        # (run, precision) → lag → requests, over the process's life
        self._total: dict[tuple[str, str], Tally[int]] = {}
        self._versions: dict[str, list[int]] = {}

    def note_pick(self, snap: FleetSnapshot, run_id: str, engine: EngineView) -> None:
        """The router sent a request of `run_id` to `engine`, deciding on `snap`."""
        run = snap.runs.get(run_id)
        latest = run.latest_version if run is not None else None
        self.note(run_id, engine.precision.value, latest, engine.applied_version)

    def note(self, run_id: str, precision: str, latest: int | None, applied: int | None) -> None:
        """One request routed to an engine serving `applied` while `latest` was the newest."""
        if latest is None or applied is None:
            return
        lag = max(0, latest - applied)
        tally = self._by_version.get((run_id, latest))
        if tally is None:
            tally = self._by_version[(run_id, latest)] = Tally()
            self._keep(run_id, latest)
        tally[(precision, lag)] += 1
        total = self._total.get((run_id, precision))
        if total is None:
            total = self._total[(run_id, precision)] = Tally()
        total[lag] += 1

    def _keep(self, run_id: str, version: int) -> None:
        versions = self._versions.setdefault(run_id, [])
        versions.append(version)
        while len(versions) > VERSIONS_KEPT:
            self._by_version.pop((run_id, versions.pop(0)), None)

    def figures(self, run_id: str, version: int, precision: str | None) -> dict[str, int | None]:
        """Requests and lag percentiles while `version` was the latest (one precision, or
        all of them with None)."""
        lags: Tally[int] = Tally()
        for (p, lag), n in self._by_version.get((run_id, version), Tally()).items():
            if precision is None or p == precision:
                lags[lag] += n
        total = sum(lags.values())
        return {
            "requests": total,
            "p50": _quantile(lags, total, 0.5),
            "p90": _quantile(lags, total, 0.9),
            "p99": _quantile(lags, total, 0.99),
            "max": max(lags) if lags else None,
        }

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "tether_request_version_lag",
            "Versions between the run's latest and the version of the engine each routed "
            "request went to, by run and precision",
            labels=["run", "precision"],
        )
        for (run_id, precision), lags in list(self._total.items()):
            buckets = [
                (str(bound), float(sum(n for lag, n in lags.items() if lag <= bound)))
                for bound in LAG_BUCKETS
            ]
            total = float(sum(lags.values()))
            buckets.append(("+Inf", total))
            family.add_metric(
                [run_id, precision], buckets, float(sum(lag * n for lag, n in lags.items()))
            )
        yield family


def _quantile(lags: Tally[int], total: int, q: float) -> int | None:
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for lag in sorted(lags):
        seen += lags[lag]
        if seen >= rank:
            return lag
    return max(lags)
