"""Test building blocks: published version chains, bit-for-bit comparison, thread races."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from store.codecs import encode_version
from store.store import Store
from store.synthetic import random_checkpoint, small_update
from store.tensors import RawTensor
from store.types import VersionRef


def publish_chain(
    store: Store,
    run_id: str,
    kinds: str,
    *,
    seed: int = 0,
    codec: str = "sparse",
    shard_bytes: int = 16_384,
) -> dict[int, dict[str, RawTensor]]:
    """Publish versions 0, 1, ... with kinds given as letters ("FDDFD": FULL/DELTA).

    Each version is a small update of the previous one; returns the tensors of each version.
    """
    store.create_run(run_id)
    tensors = random_checkpoint(seed=seed)
    history: dict[int, dict[str, RawTensor]] = {}
    previous: dict[str, RawTensor] | None = None
    for version, kind in enumerate(kinds):
        if previous is not None:
            tensors = small_update(previous, seed=seed * 1000 + version)
        files = encode_version(
            tensors,
            previous if kind == "D" else None,
            version=version,
            base_version=version - 1 if kind == "D" else None,
            codec=codec if kind == "D" else "full",
            shard_bytes=shard_bytes,
        )
        store.publish(VersionRef(run_id, version), files)
        history[version] = tensors
        previous = tensors
    return history


def same_tensors(left: dict[str, RawTensor], right: dict[str, RawTensor]) -> bool:
    """Bit-for-bit equality of two checkpoints (names, dtypes, shapes and bytes)."""
    return left.keys() == right.keys() and all(
        left[k].dtype == right[k].dtype
        and left[k].shape == right[k].shape
        and bytes(left[k].data) == bytes(right[k].data)
        for k in left
    )


def race(calls: Sequence[Callable[[], object]], timeout_s: float = 60.0) -> list[str]:
    """Run `calls` in threads released together; each outcome is "won" or the error's name."""
    barrier = threading.Barrier(len(calls))
    outcomes: list[str] = ["unfinished"] * len(calls)

    def attempt(index: int) -> None:
        barrier.wait()
        try:
            calls[index]()
            outcomes[index] = "won"
        except Exception as exc:  # recorded, so the caller's assertion names it
            outcomes[index] = type(exc).__name__

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    return outcomes
