"""What warming the kernels costs a fresh process, and what it leaves to the first catch-up.

Owns measuring, each in a fresh interpreter (a process loads each compiled kernel once, so
only a new process shows the cost), four ways to start: `agent` (what an engine agent runs
at boot: `store.codecs.warm.warm_decoders()`, folding the shipped delta, then
`engine_agent.precision.warm.warm_conversion(precision)`), `decoders` (the first alone),
`encoders` (`warm()`: encode the delta, then fold it) and `none`. After the warm-up each
process folds an update of a large model's tensors (`large_update`: blocks that the fold
fills from the base, a base loaded read-only, as an agent's is) twice, then converts a
decoder layer of 1024-square weights to `--precision` twice (each a first, full
conversion, as an agent's first staged version): a first run's extra seconds over the
second are the kernels the warm-up left to it. Also the process's CPU from start to exit.
The ways alternate, `--runs` of each. With `--cold` each process gets an empty
`NUMBA_CACHE_DIR`, so it compiles every kernel it calls, as on a fresh install. Prints a
table, then one JSON line with the medians. Never asserts; never used outside `bench/`.

    python -m bench.warm [--runs 3] [--cold] [--precision nvfp4]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

from bench.figures import significant

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("agent", "decoders", "encoders", "none")
PROBE = "import sys; from bench.warm import child; child(*sys.argv[1:])"
COLUMNS = (
    "warm_s",
    "first_fold_s",
    "next_fold_s",
    "first_convert_s",
    "next_convert_s",
    "process_cpu_s",
)
# The side of the converted layer's Linear weights (7 of them: 7.3 M parameters).
CONVERTED_SIDE = 1024
# Elements per tensor of `large_update`: past one 4 Mi-element block, whose 8 MiB the fold
# fills from the base as it applies it (`sparse_v2._FILL_MIN_BYTES`).
LARGE = 5 << 20


def large_update(seed: int = 11) -> tuple[dict, dict]:
    """(base, target) of BF16 tensors of `LARGE` elements: 1 % of values moved by 1-3 ulps
    (coded by steps), and a trained weight's Gaussian values after an Adam-like step
    (coded by class); the base read-only, as an agent's loaded checkpoint is."""
    from store.tensors import RawTensor

    rng = np.random.default_rng(seed)
    bits = rng.integers(0x3000, 0x3E00, LARGE).astype("<u2")
    moved = bits + (rng.random(LARGE) < 0.01) * rng.integers(1, 4, LARGE)
    values = (rng.standard_normal(LARGE) * 0.02).astype("<f4")
    stepped = values + 3e-5 * np.sign(rng.standard_normal(LARGE)).astype("<f4")
    pairs = {
        "uniform": (bits, moved.astype("<u2")),
        # float32 to BF16 bits, rounding half up (ties are rare enough not to matter here)
        "adam": tuple(((v.view("<u4") + 0x8000) >> 16).astype("<u2") for v in (values, stepped)),
    }
    base, target = {}, {}
    for name, (old, new) in pairs.items():
        old.flags.writeable = False
        base[name] = RawTensor("BF16", (LARGE,), old.view(np.uint8))
        target[name] = RawTensor("BF16", (LARGE,), new.view(np.uint8))
    return base, target


def child(way: str, precision: str) -> None:
    """In a fresh process: warm up `way`'s way, then fold `large_update` twice and convert
    a decoder layer to `precision` twice; prints one JSON line of the seconds."""
    from engine_agent.precision.incremental import VersionConverter
    from engine_agent.precision.warm import input_scales, warm_conversion, warm_layer
    from store.codecs import decode_version, encode_version
    from store.codecs import warm as codecs_warm

    started = time.perf_counter()
    if way in ("agent", "decoders"):
        codecs_warm.warm_decoders()
    elif way == "encoders":
        codecs_warm.warm()
    if way == "agent":
        warm_conversion(precision)
    warmed = time.perf_counter() - started
    base, target = large_update()
    files = encode_version(target, base, version=1, base_version=0, codec="sparse")
    layer = warm_layer(CONVERTED_SIDE)
    scales = input_scales(layer, precision)

    def fold() -> None:
        decode_version(files, base)

    def convert() -> None:
        VersionConverter(precision).convert(layer, {}, scales)

    seconds = {"warm_s": warmed}
    for name, job in (("fold", fold), ("convert", convert)):
        for run in ("first", "next"):
            begun = time.perf_counter()
            job()
            seconds[f"{run}_{name}_s"] = time.perf_counter() - begun
    print(json.dumps(seconds))


def _once(way: str, precision: str, cold: bool) -> tuple[dict[str, float], float]:
    """(the child's seconds, CPU seconds of the whole process)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="tether-numba-") as cache:
        if cold:
            env["NUMBA_CACHE_DIR"] = cache
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(
            [sys.executable, "-c", PROBE, way, precision],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(done.stdout.splitlines()[-1]), cpu


def main(
    runs: int = typer.Option(3, min=1, help="fresh processes of each way, alternating"),
    cold: bool = typer.Option(False, help="an empty numba cache in each process (compiles)"),
    precision: str = typer.Option("nvfp4", help="the converted precision: fp8 or nvfp4"),
) -> None:
    if precision not in ("fp8", "nvfp4"):
        raise typer.BadParameter(f"fp8 or nvfp4, not {precision!r}", param_hint="--precision")
    seen: dict[str, dict[str, list[float]]] = {way: {} for way in WAYS}
    for _ in range(runs):
        for way in WAYS:
            seconds, used = _once(way, precision, cold)
            for key, value in {**seconds, "process_cpu_s": used}.items():
                seen[way].setdefault(key, []).append(value)
    print(
        f"numba cache: {'cold (empty per process)' if cold else 'as installed'}; "
        f"conversion to {precision}"
    )
    shown = {
        (way, key): " / ".join(f"{value:.3f}" for value in seen[way][key])
        for way in WAYS
        for key in COLUMNS
    }
    width = {key: max(len(key), *(len(shown[way, key]) for way in WAYS)) + 2 for key in COLUMNS}
    print(f"{'warm-up':<10} " + "".join(f"{key:<{width[key]}}" for key in COLUMNS))
    for way in WAYS:
        print(f"{way:<10} " + "".join(f"{shown[way, key]:<{width[key]}}" for key in COLUMNS))
    median = {
        way: {key: statistics.median(values) for key, values in seen[way].items()} for way in WAYS
    }
    figures: dict[str, object] = {
        "runs": runs,
        "cold_cache": cold,
        "precision": precision,
        "large_update_elements": 2 * LARGE,
        **{
            f"{way}_{key}": significant(median[way][key])
            for way in WAYS
            for key in COLUMNS
            if not (way == "none" and key == "warm_s")
        },
        "encoders_over_decoders": significant(
            median["encoders"]["warm_s"] / median["decoders"]["warm_s"]
        ),
        # What each way's warm-up left to the first fold and the first conversion: their
        # extra seconds over the next.
        **{
            f"{way}_first_{job}_extra_s": significant(
                median[way][f"first_{job}_s"] - median[way][f"next_{job}_s"]
            )
            for way in WAYS
            for job in ("fold", "convert")
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    typer.run(main)
