"""The codec thread pools: tensors of a version, and blocks of a large tensor, in parallel.

numpy's bulk operations, zstd and xxh3 release the GIL, so encoding and applying deltas
scale over cores with plain threads. Two pools, never one: a tensor task waits on its
blocks, so blocks need workers that tensor tasks cannot all occupy (one shared pool could
deadlock). `set_threads(1)` runs everything inline on the caller's thread (what a per-core
figure measures). This module never interprets tensors or payloads.

Small tensors go together (`tasks`): a tensor under `SMALL_BYTES` spends about as long in
Python between its kernels as in them, and two threads each running such tensors hand the
GIL to each other at every kernel (about 1,100 handoffs and 2,200 context switches per
encode of a 0.1 B-parameter checkpoint's 225 small tensors), which cost more CPU than the
second core gave: 2 threads ran 0.96-1.11x one. Run in batches, each batch on one thread,
the small tensors' Python mostly overlaps the large tensors' kernels instead: 1.36-1.42x
(`python -m bench.codec --only-two-core`, docs/benchmarks.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_threads = max(1, int(os.environ.get("TETHER_CODEC_THREADS", "0")) or os.cpu_count() or 1)
_pools: dict[str, ThreadPoolExecutor] = {}


def threads() -> int:
    """How many threads each pool runs (1 = everything inline)."""
    return _threads


def set_threads(count: int) -> None:
    """Use `count` threads per pool from now on (≥ 1); running tasks finish on the old pools."""
    global _threads
    if count < 1:
        raise ValueError(f"codec threads must be at least 1, got {count}")
    with _lock:
        _threads = count
        old = list(_pools.values())
        _pools.clear()
    for pool in old:
        pool.shutdown(wait=False)


def _pool(kind: str) -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.get(kind)
        if pool is None:
            pool = _pools[kind] = ThreadPoolExecutor(_threads, thread_name_prefix=f"codec-{kind}")
        return pool


def _map(kind: str, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    work = list(items)
    if (
        _threads == 1
        or len(work) < 2
        or threading.current_thread().name.startswith(f"codec-{kind}")
    ):
        return [fn(item) for item in work]
    return list(_pool(kind).map(fn, work))


# A tensor smaller than this is batched with others (see the module's docstring), and the
# fixed cost of a tensor's Python glue counted as this many bytes of work.
SMALL_BYTES = 1 << 20
TENSOR_OVERHEAD_BYTES = 1 << 18


def tasks(sizes: Sequence[int], count: int) -> list[list[int]]:
    """The indices of tensors of `sizes` bytes grouped into tasks for `count` threads,
    largest task first: a tensor of at least `SMALL_BYTES` alone; smaller ones together, in
    their order, in batches of at most a thread's fair share of the work (the work of all
    divided by `count`; a tensor's work is its bytes and `TENSOR_OVERHEAD_BYTES`)."""
    work = [size + TENSOR_OVERHEAD_BYTES for size in sizes]
    share = sum(work) / max(1, count)
    groups: list[list[int]] = []
    batch: list[int] = []
    batch_work = 0
    for i, size in enumerate(sizes):
        if size >= SMALL_BYTES:
            groups.append([i])
            continue
        if batch and batch_work + work[i] > share:
            groups.append(batch)
            batch, batch_work = [], 0
        batch.append(i)
        batch_work += work[i]
    if batch:
        groups.append(batch)
    return sorted(groups, key=lambda group: -sum(work[i] for i in group))


def map_tensors(
    fn: Callable[[T], R], items: Iterable[T], sizes: Sequence[int] | None = None
) -> list[R]:
    """`[fn(x) for x in items]`, tensors in parallel; results in order, first error raised.
    With `sizes` (each item's bytes), small tensors run in batches (`tasks`)."""
    work = list(items)
    if sizes is None or _threads == 1 or len(work) < 2:
        return _map("tensor", fn, work)
    groups = tasks(sizes, _threads)
    done = _map("tensor", lambda group: [fn(work[i]) for i in group], groups)
    results: dict[int, R] = {}
    for group, outs in zip(groups, done, strict=True):
        results.update(zip(group, outs, strict=True))
    return [results[i] for i in range(len(work))]


def map_blocks(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """Like `map_tensors`, on the block pool (for the blocks of one tensor)."""
    return _map("block", fn, items)
