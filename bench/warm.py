"""What warming the codecs costs a fresh process, and what it leaves to the first fold.

Owns measuring, each in a fresh interpreter (a process loads each compiled kernel once, so
only a new process shows the cost), the seconds `store.codecs.warm.warm_decoders()` (what
an engine agent runs at boot: fold the shipped delta) and `warm()` (encode that delta, then
fold it) report, and the process's CPU from start to exit, imports included. After the
warm-up each process folds an update of a large model's tensors (`large_update`: blocks
that the fold fills from the base, a base loaded read-only, as an agent's is) twice: the
first fold's extra seconds over the second are the kernels the warm-up left to it. The
ways alternate, `--runs` of each; `none` does not warm. With `--cold` each process gets an
empty `NUMBA_CACHE_DIR`, so it compiles every kernel it calls, as on a fresh install.
Prints a table, then one JSON line with the medians and `encoders_over_decoders`. Never
asserts; never used outside `bench/`.

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
import time
from pathlib import Path

import numpy as np
import typer

from bench.figures import significant

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"decoders": "warm_decoders", "encoders": "warm", "none": ""}
PROBE = "import sys; from bench.warm import child; child(sys.argv[1])"
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


def child(function: str) -> None:
    """In a fresh process: warm up with `function` of `store.codecs.warm` (none if empty),
    then fold `large_update` twice; prints one JSON line of the seconds."""
    from store.codecs import decode_version, encode_version
    from store.codecs import warm as codecs_warm

    warmed = getattr(codecs_warm, function)() if function else 0.0
    base, target = large_update()
    files = encode_version(target, base, version=1, base_version=0, codec="sparse")
    folds = []
    for _ in range(2):
        started = time.perf_counter()
        decode_version(files, base)
        folds.append(time.perf_counter() - started)
    print(json.dumps({"warm_s": warmed, "first_fold_s": folds[0], "next_fold_s": folds[1]}))


def _once(function: str, cold: bool) -> tuple[dict[str, float], float]:
    """(the child's seconds, CPU seconds of the whole process)."""
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
    return json.loads(done.stdout.splitlines()[-1]), cpu


def main(
    runs: int = typer.Option(3, min=1, help="fresh processes of each way, alternating"),
    cold: bool = typer.Option(False, help="an empty numba cache in each process (compiles)"),
) -> None:
    seen: dict[str, dict[str, list[float]]] = {way: {} for way in WAYS}
    for _ in range(runs):
        for way, function in WAYS.items():
            figures, used = _once(function, cold)
            for key, value in {**figures, "process_cpu_s": used}.items():
                seen[way].setdefault(key, []).append(value)
    print(f"numba cache: {'cold (empty per process)' if cold else 'as installed'}")
    columns = ("warm_s", "first_fold_s", "next_fold_s", "process_cpu_s")
    shown = {
        (way, key): " / ".join(f"{value:.3f}" for value in seen[way][key])
        for way in WAYS
        for key in columns
    }
    width = {key: max(len(key), *(len(shown[way, key]) for way in WAYS)) + 2 for key in columns}
    print(f"{'warm-up':<10} " + "".join(f"{key:<{width[key]}}" for key in columns))
    for way in WAYS:
        print(f"{way:<10} " + "".join(f"{shown[way, key]:<{width[key]}}" for key in columns))
    median = {
        way: {key: statistics.median(values) for key, values in seen[way].items()} for way in WAYS
    }
    figures = {
        "runs": runs,
        "cold_cache": cold,
        "large_update_elements": 2 * LARGE,
        **{
            f"{way}_{key}": significant(median[way][key])
            for way in WAYS
            for key in columns
            if not (way == "none" and key == "warm_s")
        },
        "encoders_over_decoders": significant(
            median["encoders"]["warm_s"] / median["decoders"]["warm_s"]
        ),
        # What the warm-up left to the first fold, per way: its extra seconds over the next.
        **{
            f"{way}_first_fold_extra_s": significant(
                median[way]["first_fold_s"] - median[way]["next_fold_s"]
            )
            for way in WAYS
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    typer.run(main)
