"""`SourcedFetch`: a file from the first source whose bytes match the store's digest.

The digests come from the origin store (a version's `.tether-claim`, written before any of
its bytes, holds each file's size and xxh3-128 digest), never from a source, so a source
can slow a catch-up but never corrupt it: bytes that do not match are thrown away before
anything decodes them. A source that serves wrong bytes, fails or stalls is dropped for the
rest of this fetch and reported through `on_fault`; a miss (404) is not a fault. When no
source delivers, the caller reads the origin as it always did. With `attempts` (the file is
being passed on to peers while it arrives), each source writes its bytes there as they come
and the attempt is released only once its bytes matched. Never writes anything.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from store.checksum import tensor_checksum
from store.sources.base import FetchSource, SourceFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileDigest:
    """What the origin store recorded for one file: its size and xxh3-128 digest."""

    size: int
    digest: str


@dataclass(frozen=True)
class SourceFault:
    """A source dropped during a fetch: which, for which key, why (`digest`, `size`,
    `stall`, `error`, `unavailable`) and the message."""

    source: FetchSource
    key: str
    reason: str
    message: str


class Attempts(Protocol):
    """Successive attempts at one file, readable by others while they arrive
    (`store.cache.Attempts`)."""

    def sink(self) -> Callable[[bytes], None]:
        """Where the next attempt writes its bytes as they arrive."""

    def failed(self) -> None:
        """The attempt under way failed: its readers stop."""

    def verified(self) -> None:
        """The attempt's bytes matched the origin's record: readers may finish."""


class SourcedFetch:
    """Tries `sources` in order for each file; keeps using those that behave."""

    def __init__(
        self,
        sources: Iterable[FetchSource],
        on_fault: Callable[[SourceFault], None] | None = None,
        first: concurrent.futures.Future[list[FetchSource]] | None = None,
        first_wait_s: float = 30.0,
    ) -> None:
        self._sources = list(sources)
        # Sources to try before `sources`, still being found (a fetch plan being asked for
        # while the reader plans from the store); waited for at first use.
        self._first = first
        self.first_wait_s = first_wait_s
        self.on_fault = on_fault
        self.faults: list[SourceFault] = []
        # Bytes used, by source kind ("peer", "http", ... and "store" for the origin).
        self.bytes_from: Counter[str] = Counter()
        # Bytes received and thrown away because they did not match the digest.
        self.bytes_rejected = 0

    @property
    def sources(self) -> list[FetchSource]:
        """The sources still in use, in order. The first use waits (at most `first_wait_s`)
        for sources still being found: use it from a worker thread, never from the event
        loop that finds them."""
        if self._first is not None:
            first, self._first = self._first, None
            try:
                self._sources[:0] = first.result(timeout=self.first_wait_s)
            except (TimeoutError, concurrent.futures.CancelledError):
                first.cancel()
                log.info("no fetch plan within %.0fs; reading the store", self.first_wait_s)
            except Exception as exc:  # finding them failed: the store serves, as without
                log.info("no fetch sources (%s: %s); reading the store", type(exc).__name__, exc)
        return self._sources

    def fetch(
        self, key: str, expected: FileDigest, attempts: Attempts | None = None
    ) -> bytes | None:
        """The bytes of `key` from the first source that delivers them intact, or None."""
        for source in list(self.sources):
            sink = attempts.sink() if attempts is not None else None
            try:
                data = source.fetch(key, expected.size, sink)
            except FileNotFoundError:
                if attempts is not None:
                    attempts.failed()
                continue
            except SourceFailed as exc:
                if attempts is not None:
                    attempts.failed()
                self._drop(source, key, exc.reason, str(exc))
                continue
            fault = self._mismatch(source, key, data, expected)
            if fault is not None:
                if attempts is not None:
                    attempts.failed()
                self.bytes_rejected += len(data)
                self._drop(source, key, *fault)
                continue
            if attempts is not None:
                attempts.verified()
            self.bytes_from[source.kind] += len(data)
            return data
        return None

    @staticmethod
    def _mismatch(
        source: FetchSource, key: str, data: bytes, expected: FileDigest
    ) -> tuple[str, str] | None:
        """(reason, message) if `data` is not what the origin recorded, else None."""
        if len(data) != expected.size:
            return "size", (
                f"{source.location} served {len(data)} bytes for {key}, the store "
                f"records {expected.size}"
            )
        digest = tensor_checksum(data)
        if digest != expected.digest:
            return "digest", (
                f"{source.location} served bytes of {key} with digest {digest}, the store "
                f"records {expected.digest}"
            )
        return None

    def count_origin(self, size: int) -> None:
        """Bytes the reader took from the origin store (when no source delivered)."""
        self.bytes_from["store"] += size

    def _drop(self, source: FetchSource, key: str, reason: str, message: str) -> None:
        if source in self.sources:
            self.sources.remove(source)
        fault = SourceFault(source, key, reason, message)
        self.faults.append(fault)
        log.warning("dropped fetch source %s (%s): %s", source.location, reason, message)
        if self.on_fault is not None:
            self.on_fault(fault)

    def close(self) -> None:
        if self._first is not None:
            self._first.cancel()
        for source in self._sources:
            source.close()
        for fault in self.faults:
            fault.source.close()
