"""The fetch-source port: one place, besides the origin store, that may hold version files.

A source answers one question: the bytes of a store key. It never verifies them (the
caller checks every byte against the digests read from the origin store) and never writes.
A source that does not hold the key raises `FileNotFoundError` (a miss, nothing wrong);
one that fails or stalls raises `SourceFailed` (a fault, reported and dropped).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from store.errors import StoreError


class SourceFailed(StoreError):
    """A fetch source failed to deliver a file: no answer, an error answer, or a stall.

    `reason` is a short machine-readable word (`stall`, `error`, `unavailable`) for metrics
    and reports. `suspect`: the bytes it delivered before failing may be wrong (a peer
    forwarding a file that failed its own check), so nothing may be continued from them.
    Recovery: drop the source for this catch-up and try the next one.
    """

    def __init__(self, message: str, reason: str = "error", suspect: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.suspect = suspect


class FetchSource(ABC):
    """Bytes of store keys from somewhere other than the origin store."""

    # What kind of source this is (`peer`, `http`, `objects`): the label of its metrics.
    kind: str
    # Where it is (a URL), for logs and fault reports; never holds a credential.
    location: str

    @abstractmethod
    def fetch(
        self,
        key: str,
        size: int,
        sink: Callable[[bytes], None] | None = None,
        offset: int = 0,
    ) -> bytes:
        """The object `key`, which the origin says is `size` bytes long, from byte `offset`
        on (the whole of it by default; a later offset continues a transfer that another
        source began).

        With `sink`, every byte received is also passed to it, in order, as it arrives (so
        that the caller can forward a file before it is complete, or continue from where a
        failed source stopped); the bytes returned are the same ones. Raise
        `FileNotFoundError` if this source does not hold it, `SourceFailed` if the source
        fails or stalls. The bytes returned may still be wrong: the caller verifies.
        """

    def close(self) -> None:  # noqa: B027  (most sources hold nothing to release)
        """Release connections (nothing by default)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"
