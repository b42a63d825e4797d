"""Retention: which versions of a run to keep, given how many of the newest to hold.

Kept: the newest `keep` complete versions, the version the pointer names, and, for each of
those, every version its delta chain needs back to a FULL anchor, so each kept version can
still be reconstructed. Everything else may go. Deciding is pure; `Store.gc` deletes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from store.errors import InvalidVersion

# version -> base_version (None for FULL versions).
BaseOf = Callable[[int], int | None]


@dataclass(frozen=True)
class GcReport:
    """What `gc` kept and deleted (or would delete, when `dry_run`)."""

    run_id: str
    kept: list[int]
    deleted: list[int]
    incomplete_deleted: list[int] = field(default_factory=list)
    objects_deleted: int = 0
    bytes_freed: int = 0
    dry_run: bool = False


def versions_to_keep(
    versions: Collection[int], keep: int, *, base_of: BaseOf, pointer: int | None
) -> set[int]:
    """The complete versions that retention must keep (see the module docstring)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidVersion(f"keep must be a positive integer, got {keep!r}; keep at least 1")
    present = set(versions)
    roots = set(sorted(present)[-keep:])
    if pointer is not None and pointer in present:
        roots.add(pointer)
    kept: set[int] = set()
    for root in roots:
        version: int | None = root
        while version is not None and version in present and version not in kept:
            kept.add(version)
            version = base_of(version)
    return kept
