"""The catch-up stages of one version, each in GB/s of checkpoint per core and on the wall.

Owns the measurement `tether bench codec` and `tether bench refit` both report: fetch a
version's files from a folder store, fold + verify them onto the base, convert the result
to FP8 and to NVFP4 (the agent's converters), write the staged BF16 folder. Per core =
checkpoint bytes per second of this thread's CPU time with one codec thread and one torch
thread, so a shared machine's other processes do not count; wall = the same run's clock.
Never starts processes or reads the network; it writes only under the folder it is given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from bench.figures import significant

if TYPE_CHECKING:
    from store.cache import VersionFiles

T = TypeVar("T")
STAGES = ("fetch", "fold_verify", "convert_fp8", "convert_nvfp4", "write_staged")


def least_cpu(fn: Callable[[], T], repeats: int = 1) -> tuple[T, float]:
    """Run `fn` `repeats` times on this thread; return its result and the least CPU seconds
    this thread spent on one run (the run least disturbed by other processes).

    With codec threads = 1 every byte is coded on this thread, so CPU seconds are the time on
    a core of its own, whatever else the (shared) machine runs.
    """
    return _timed(fn, repeats)[:2]


def _timed(fn: Callable[[], T], repeats: int) -> tuple[T, float, float]:
    """(result, least thread CPU seconds, wall seconds of that same run)."""
    best, wall = math.inf, math.inf
    result = None
    for _ in range(repeats):
        # Drop the previous run's output first, as a caller that keeps only the newest
        # version does: a fold then reuses its memory rather than faulting in fresh pages.
        result = None
        started, started_wall = time.thread_time(), time.perf_counter()
        result = fn()
        cpu = time.thread_time() - started
        if cpu < best:
            best, wall = cpu, time.perf_counter() - started_wall
    return result, best, wall  # type: ignore[return-value]


def _fetched(files: VersionFiles) -> VersionFiles:
    files.fetch_all()
    return files


def catchup_stages(
    target: Mapping, base: Mapping, root: Path, repeats: int = 1
) -> tuple[dict[str, float], dict[str, float]]:
    """(per core, wall): GB/s of `target`'s checkpoint bytes for each stage of catching up
    from `base` to `target` published as one sparse delta, keyed `<stage>_gb_s`. Each stage
    but the write (which must not find its folder) is the least of `repeats` runs."""
    import torch

    from engine_agent.precision.checkpoint import write_safetensors_folder
    from engine_agent.precision.convert import convert_tensors
    from engine_agent.precision.plan import plan_quantization
    from store.codecs import encode_version, fold, workers
    from store.codecs.warm import warm
    from store.store import Store
    from store.tensors import total_bytes
    from store.torch_bridge import raw_to_state_dict
    from store.types import VersionRef

    # Loading the codecs' kernels is a process's once-only cost, which an agent pays at
    # boot (`store/codecs/warm.py`), not a fold's: a first run must not be charged with it.
    warm()
    full = total_bytes(target)
    codec_threads, torch_threads = workers.threads(), torch.get_num_threads()
    workers.set_threads(1)
    torch.set_num_threads(1)
    seconds: dict[str, tuple[float, float]] = {}

    def stage(name: str, fn: Callable[[], T], runs: int = repeats) -> T:
        result, cpu, wall = _timed(fn, runs)
        seconds[name] = (cpu, wall)
        return result

    try:
        store = Store(str(root / "store"))
        store.create_run("bench")
        store.publish(
            VersionRef("bench", 1),
            encode_version(target, base, version=1, base_version=0, codec="sparse"),
        )
        files = stage("fetch", lambda: _fetched(store.open_version(VersionRef("bench", 1))))
        tensors = stage("fold_verify", lambda: fold(base, [files]))
        state = raw_to_state_dict(tensors)
        stage("convert_fp8", lambda: convert_tensors(state, {}, "fp8"))
        scales = {m: 1.0 for m in plan_quantization(state, "nvfp4").quantized}
        stage("convert_nvfp4", lambda: convert_tensors(state, {}, "nvfp4", scales))
        # Once: a second write would find the folder of the first.
        stage("write_staged", lambda: write_safetensors_folder(root / "staged", state), 1)
    finally:
        torch.set_num_threads(torch_threads)
        workers.set_threads(codec_threads)

    def rates(which: int) -> dict[str, float]:
        return {
            f"{name}_gb_s": significant(full / max(seconds[name][which], 1e-9) / 1e9)
            for name in STAGES
        }

    return rates(0), rates(1)
