"""The port between the store and the thing that holds its bytes (a folder, memory, S3).

An `ObjectStore` speaks in keys relative to the store root ("run-a/latest") and offers the
few operations the store's protocol needs: whole-object reads and writes that readers see
all-or-nothing, create-only writes, ranged reads, one-level listings, prefix deletion, and
a compare-and-swap cell for the pointer. A transient failure is always `StorageUnavailable`
(`transient_os_errors` for file-based adapters). Adapters never interpret the bytes they hold and
never decide policy (what may be overwritten, which way a pointer may move): `Store` does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from store.errors import StorageUnavailable

# OS errors that answer the question asked (absent, present, wrong kind, not allowed);
# every other OSError (EIO, ENOSPC, a stale NFS handle, ...) is a transient failure.
_ANSWERS = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


@dataclass(frozen=True)
class Listing:
    """The immediate children of a prefix: sub-folder names and file names with sizes."""

    dirs: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Cell:
    """A compare-and-swap cell's content as read, with the token a swap must present.

    `data` is None when the cell does not exist yet. The token is opaque to callers (an S3
    ETag, or the content itself for local and in-memory stores).
    """

    data: bytes | None
    token: object


class ObjectStore(ABC):
    """Bytes under keys. Every write is atomic for readers: they see all of it or none."""

    url: str

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; `FileNotFoundError` if it does not exist."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from `start` (fewer at the end of the object)."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None if it does not exist."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace the object."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if no object has the key; False (nothing written) if one does."""

    @abstractmethod
    def list(self, prefix: str) -> Listing:
        """Immediate children of `prefix` (which ends with "/", or is "" for the root)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Delete one object; False if there was none."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix`; return how many were deleted."""

    @abstractmethod
    def read_cell(self, key: str) -> Cell:
        """Read a compare-and-swap cell (the pointer)."""

    @abstractmethod
    def swap_cell(self, key: str, data: bytes, token: object) -> None:
        """Replace the cell's content if it still matches `token` (from `read_cell`).

        Raise `PointerConflict` if another writer changed (or created) the cell since.
        """


@contextmanager
def transient_os_errors(where: str) -> Iterator[None]:
    """Turn an OS failure of the storage at `where` into `StorageUnavailable`, the one
    retryable error type of every adapter; answers (`FileNotFoundError`, ...) pass as they
    are."""
    try:
        yield
    except _ANSWERS:
        raise
    except OSError as exc:
        raise StorageUnavailable(
            f"I/O on {where} failed ({type(exc).__name__}: {exc}); retry once the disk or "
            "mount is healthy"
        ) from exc
