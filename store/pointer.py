"""A run's pointer, `<run_id>/latest`: what it says, and the only way it moves.

The pointer is text naming one version (`<run_id>/weight_v000007`). It moves by
compare-and-swap on the object store's cell (S3 conditional writes, a file lock and atomic
rename, or an in-process lock), so of two writers that read the same pointer only one can
move it; the other gets `PointerConflict`. The move also obeys `decide_pointer_move`: within
a run it only goes forward, and a run's first pointer is never below its boot version.
This module never checks that the named version's bytes are complete: `Store` does that
before it calls `move`.
"""

from __future__ import annotations

import enum
import logging
from typing import Literal

from store.errors import CorruptPayload, InvalidName, PointerConflict, PointerRewind
from store.layout import pointer_key
from store.objects import ObjectStore
from store.types import VersionRef, decide_pointer_move

log = logging.getLogger(__name__)


class Expect(enum.Enum):
    """`Expect.READ_NOW`: take the pointer as it is when the operation starts as expected."""

    READ_NOW = "read-now"


READ_NOW = Expect.READ_NOW
Expected = VersionRef | None | Literal[Expect.READ_NOW]


def encode_pointer(ref: VersionRef) -> bytes:
    """The pointer's content: the identity string, no newline (as Stitch writes it)."""
    return ref.identity.encode()


def decode_pointer(run_id: str, data: bytes) -> VersionRef:
    """Parse a pointer's content; `CorruptPayload` if it does not name a version of `run_id`."""
    try:
        ref = VersionRef.parse(data.decode("utf-8"))
    except (UnicodeDecodeError, InvalidName) as exc:
        raise CorruptPayload(
            f"pointer of run {run_id!r} holds {data[:80]!r}, expected "
            f"'{run_id}/weight_vNNNNNN'; rewrite it with a valid identity ({exc})"
        ) from exc
    if ref.run_id != run_id:
        raise CorruptPayload(
            f"pointer of run {run_id!r} names {ref.identity}, a version of another run"
        )
    return ref


class Pointer:
    """The `latest` cell of one run."""

    def __init__(self, objects: ObjectStore, run_id: str) -> None:
        self.objects = objects
        self.run_id = run_id
        self.key = pointer_key(run_id)

    def read(self) -> tuple[VersionRef | None, object]:
        """The version the pointer names now (None if unset) and the token to swap it."""
        cell = self.objects.read_cell(self.key)
        if cell.data is None:
            return None, cell.token
        return decode_pointer(self.run_id, cell.data), cell.token

    def check(self, expected: Expected, new: VersionRef, *, boot_version: int) -> VersionRef | None:
        """Raise now what `move` would raise if the pointer stayed as it is; return it."""
        current, _ = self.read()
        self._decide(current, expected, new, boot_version)
        return current

    def move(self, expected: Expected, new: VersionRef, *, boot_version: int) -> VersionRef | None:
        """Move the pointer from `expected` to `new` atomically; return the previous version.

        `expected` is the version the caller believes the pointer names (None: unset), or
        `READ_NOW` to accept whatever it names at this moment. Raise `PointerConflict` if it
        names something else or another writer moves it first, `PointerRewind` if `new`
        would not move it forward (or would start the run below `boot_version`).
        """
        current, token = self.read()
        self._decide(current, expected, new, boot_version)
        self.objects.swap_cell(self.key, encode_pointer(new), token)
        log.info("pointer of run %s moved %s -> %s", self.run_id, current, new)
        return current

    def _decide(
        self, current: VersionRef | None, expected: Expected, new: VersionRef, boot_version: int
    ) -> None:
        if new.run_id != self.run_id:
            raise InvalidName(
                f"pointer of run {self.run_id!r} cannot name {new.identity}; "
                "publish to that run's own pointer"
            )
        if expected is not READ_NOW and expected != current:
            raise PointerConflict(
                f"pointer of run {self.run_id!r} names {_show(current)}, this writer expected "
                f"{_show(expected)}; another writer moved it. Re-read the pointer and decide again"
            )
        decide_pointer_move(current, new)
        if current is None and new.version < boot_version:
            raise PointerRewind(
                f"run {self.run_id!r} starts at boot version {boot_version}, so its first "
                f"pointer cannot name {new.identity}; publish version {boot_version} or later"
            )


def _show(ref: object) -> str:
    return "nothing" if ref is None else str(ref)
