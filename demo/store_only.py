"""The store-only demo (`tether demo --store-only`): generated versions, published through the
store protocol, verified and rebuilt, with no engines and no network.

Owns the loop "next generated checkpoint → encode (the store's `VersionEncoder`: FULL or
DELTA) → publish" and the figures it ends with. It never prints: the CLI draws the progress
bar and the table from `on_version` and the returned figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from store.anchor import AnchorPolicy
from store.encoder import VersionEncoder
from store.store import Store
from store.synthetic import random_checkpoint, small_update
from store.types import VersionKind, VersionRef


def publish_generated(
    store: Store,
    run_id: str,
    versions: int,
    *,
    anchor_every: int,
    codec: str,
    seed: int,
    on_version: Callable[[int, VersionKind], None] = lambda version, kind: None,
) -> dict[str, Any]:
    """Create `run_id`, publish `versions` generated versions, verify every one and rebuild
    the newest; return the figures (kinds, sizes, verified, latest_bit_identical)."""
    started = time.perf_counter()
    store.create_run(run_id, base_checkpoint="generated:random-bf16")
    encoder = VersionEncoder(codec, AnchorPolicy(every=anchor_every))
    tensors = random_checkpoint(seed=seed)
    kinds: list[str] = []
    sizes: list[int] = []
    for version in range(versions):
        if version:
            tensors = small_update(tensors, seed=seed * 7919 + version, fraction=0.03)
        encoded = encoder.encode(tensors, version)
        store.publish(VersionRef(run_id, version), encoded.files)
        encoder.accept(encoded)
        kinds.append(str(encoded.kind))
        sizes.append(encoded.bytes)
        on_version(version, encoded.kind)
    problems = [
        problem
        for version in store.list_versions(run_id)
        for problem in store.verify(VersionRef(run_id, version)).problems
    ]
    rebuilt = store.materialize(run_id, versions - 1)
    identical = all(bytes(rebuilt[name].data) == bytes(t.data) for name, t in tensors.items())
    full_bytes = sizes[0]
    deltas = [size for size, kind in zip(sizes, kinds, strict=True) if kind == "delta"]
    return {
        "store": store.url,
        "run": run_id,
        "versions": versions,
        "pointer": str(store.read_pointer(run_id)),
        "kinds": kinds,
        "full_bytes": full_bytes,
        "mean_delta_over_full": round(sum(deltas) / len(deltas) / full_bytes, 4)
        if deltas
        else None,
        "verified": not problems,
        "latest_bit_identical": identical,
        "seconds": round(time.perf_counter() - started, 3),
    }
