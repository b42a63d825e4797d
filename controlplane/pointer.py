"""Confirms a trainer's version notice against the store, which stays the truth.

Owns the one question the control plane asks the store: does `<run>/latest` name this
version (or a newer one)? Never writes to the store.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from controlplane.errors import VersionNotAtPointer
from store.types import VersionRef

if TYPE_CHECKING:
    from store.store import Store


@lru_cache(maxsize=64)
def open_store(url: str) -> Store:
    """The store at `url`, opened once per process."""
    from store.store import Store

    return Store(url)


def read_pointer(store_url: str, run_id: str) -> VersionRef | None:
    return open_store(store_url).read_pointer(run_id)


def confirm_published(store_url: str, run_id: str, version: int) -> int:
    """Return the pointer's version if it is `version` or newer; else raise."""
    ref = read_pointer(store_url, run_id)
    if ref is None:
        raise VersionNotAtPointer(
            f"run {run_id!r} has no pointer in the store at {store_url!r}: publish the "
            f"version bytes and move the pointer before notifying",
            field="body.version",
            pointer_version=None,
        )
    if ref.version < version:
        raise VersionNotAtPointer(
            f"the store's pointer for run {run_id!r} names v{ref.version}, not v{version} or "
            "newer: move the pointer (compare-and-swap) before notifying",
            field="body.version",
            pointer_version=ref.version,
        )
    return ref.version
