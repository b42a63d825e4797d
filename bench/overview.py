"""Overview benchmark: what the dashboard adds to each fleet snapshot, and what a read costs.

In process, for fleets of 100, 1,000 and 10,000 engines (three precisions, mixed versions
and states): the time to build the fleet snapshot the router already builds (the
baseline), the time the dashboard's observer adds to each snapshot swap (convergence,
transitions, rate sampling), the time to build and encode the overview JSON (once per
snapshot, whatever the number of readers), the time of a cached read, and the encoded size.
Side by side as ratios to the snapshot build. The last line printed is one JSON object.

Run: `tether bench overview` or `python -m bench.overview --repeats 20`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import typer


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(engines: int, repeats: int) -> dict[str, float]:
    """Medians (ms) of snapshot build, observe, overview build+encode and a cached read."""
    from controlplane.metrics import Metrics
    from controlplane.overview import Overview
    from controlplane.snapshot import EngineView, FleetSnapshot, RunView
    from wire import Precision, SyncState, TargetPolicy

    now = time.time()
    states = [SyncState.READY] * 6 + [SyncState.SYNCING, SyncState.ERROR]
    views = [
        EngineView(f"e{i:05d}", "run", f"http://10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000",
                   list(Precision)[i % 3], 8, 16 + i % 4, states[i % len(states)], i % 7,
                   20 if i % 8 == 6 else None, 0.5, None, now + 3600, "h100",
                   {"engine": "sglang"})
        for i in range(engines)
    ]  # fmt: skip
    runs = [RunView("run", 19, now - 5, TargetPolicy())]

    def build() -> FleetSnapshot:
        return FleetSnapshot.build(now, views, runs, {})

    snap = build()
    overview = Overview(Metrics(), lease_seconds=10.0)
    overview.observe(snap)

    def encode_fresh() -> bytes:
        overview.observe(snap)  # a new snapshot invalidates the cached document
        return overview.encoded()

    return {
        "snapshot_build_ms": _median_ms(build, repeats),
        "observe_ms": _median_ms(lambda: overview.observe(snap), repeats),
        "overview_encode_ms": _median_ms(encode_fresh, repeats)
        - _median_ms(lambda: overview.observe(snap), repeats),
        "cached_read_us": _median_ms(overview.encoded, repeats * 100) * 1e3,
        "bytes": float(len(overview.encoded())),
    }


def run(
    repeats: int = typer.Option(15, "--repeats", min=3, help="Timed repetitions per figure."),
    sizes: str = typer.Option("100,1000,10000", "--sizes", help="Fleet sizes, comma-separated."),
) -> None:
    """Time the dashboard's per-snapshot work against the snapshot build it rides on."""
    figures: dict[str, Any] = {}
    print(f"{'engines':>8} {'snapshot':>10} {'observe':>10} {'encode':>10} {'read':>9} "
          f"{'size':>9}  observe/snap encode/snap")  # fmt: skip
    for n in (int(s) for s in sizes.split(",")):
        f = measure(n, repeats)
        figures[str(n)] = {k: round(v, 4) for k, v in f.items()}
        print(
            f"{n:>8} {f['snapshot_build_ms']:>8.2f}ms {f['observe_ms']:>8.2f}ms "
            f"{f['overview_encode_ms']:>8.2f}ms {f['cached_read_us']:>7.2f}us "
            f"{f['bytes'] / 1024:>7.0f}KiB  {f['observe_ms'] / f['snapshot_build_ms']:>11.2f}x "
            f"{f['overview_encode_ms'] / f['snapshot_build_ms']:>10.2f}x"
        )
    print(json.dumps({"bench": "overview", "repeats": repeats, "engines": figures}))


if __name__ == "__main__":
    typer.run(run)
