"""The codec thread pools: tensors of a version, and blocks of a large tensor, in parallel.

numpy's bulk operations, zstd and xxh3 release the GIL, so encoding and applying deltas
scale over cores with plain threads. Two pools, never one: a tensor task waits on its
blocks, so blocks need workers that tensor tasks cannot all occupy (one shared pool could
deadlock). `set_threads(1)` runs everything inline on the caller's thread (what a per-core
figure measures). This module never interprets tensors or payloads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
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


def map_tensors(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """`[fn(x) for x in items]`, tensors in parallel; results in order, first error raised."""
    return _map("tensor", fn, items)


def map_blocks(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """Like `map_tensors`, on the block pool (for the blocks of one tensor)."""
    return _map("block", fn, items)
