"""What warming the codecs costs a fresh process: the agent's way against encoding too.

Owns measuring, each in a fresh interpreter (a process loads each compiled kernel once, so
only a new process shows the cost), the seconds `store.codecs.warm.warm_decoders()` (what
an engine agent runs at boot: fold the shipped delta) and `warm()` (encode that delta, then
fold it) report, and the process's CPU from start to exit, imports included. The two ways
alternate, `--runs` of each. With `--cold` each process gets an empty `NUMBA_CACHE_DIR`, so
it compiles every kernel it calls, as on a fresh install. Prints a table, then one JSON line
with the medians and `encoders_over_decoders`. Never asserts; never used outside `bench/`.

    python -m bench.warm [--runs 3] [--cold]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

from bench.figures import significant

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"decoders": "warm_decoders", "encoders": "warm"}
PROBE = "import sys, store.codecs.warm as w; print(getattr(w, sys.argv[1])())"


def _once(function: str, cold: bool) -> tuple[float, float]:
    """(seconds the warm-up reported, CPU seconds of the whole process)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="tether-numba-") as cache:
        if cold:
            env["NUMBA_CACHE_DIR"] = cache
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(
            [sys.executable, "-c", PROBE, function],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(done.stdout.splitlines()[-1]), cpu


def main(
    runs: int = typer.Option(3, min=1, help="fresh processes of each way, alternating"),
    cold: bool = typer.Option(False, help="an empty numba cache in each process (compiles)"),
) -> None:
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(runs):
        for way, function in WAYS.items():
            warmed, used = _once(function, cold)
            seconds[way].append(warmed)
            cpu[way].append(used)
    print(f"numba cache: {'cold (empty per process)' if cold else 'as installed'}")
    shown = {way: " / ".join(f"{value:.3f}" for value in seconds[way]) for way in WAYS}
    width = max(len("warm-up s"), *map(len, shown.values())) + 2
    print(f"{'way':<10} {'warm-up s':<{width}} process CPU s")
    for way in WAYS:
        spent = " / ".join(f"{value:.2f}" for value in cpu[way])
        print(f"{way:<10} {shown[way]:<{width}} {spent}")
    median = {way: statistics.median(values) for way, values in seconds.items()}
    figures = {
        "runs": runs,
        "cold_cache": cold,
        **{f"{way}_s": significant(median[way]) for way in WAYS},
        **{f"{way}_process_cpu_s": significant(statistics.median(cpu[way])) for way in WAYS},
        "encoders_over_decoders": significant(median["encoders"] / median["decoders"]),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    typer.run(main)
