"""`SourcedFetch`: a file from the first source whose bytes match the store's digest.

The digests come from the origin store (a version's `.tether-claim`, written before any of
its bytes, holds each file's size and xxh3-128 digest), never from a source, so a source
can slow a catch-up but never corrupt it: bytes that do not match are thrown away before
anything decodes them. A source that serves wrong bytes, fails or stalls is dropped for the
rest of this fetch and reported through `on_fault`; a miss (404) is not a fault. When no
source delivers, the caller reads the origin as it always did. With `attempts` (the file is
being passed on to peers while it arrives), each source writes its bytes there as they come
and the attempt is released only once its bytes matched. Never writes anything.

With lanes (peer fetch over several trees, `controlplane/fetch_plan.py`), a file is asked of
its lane's sources, then of the sources of no lane (configured caches, mirrors). Files may
be fetched from several threads at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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


@dataclass
class Held:
    """The leading bytes of one file that sources delivered without finishing it, and how
    many came from each kind of source: where the origin continues from."""

    # The pieces as they arrived (references, not copies), and how many bytes they hold.
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    parts: Counter[str] = field(default_factory=Counter)

    def take(self, chunk: bytes, kind: str) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        self.parts[kind] += len(chunk)

    def clear(self) -> None:
        self.chunks.clear()
        self.size = 0
        self.parts.clear()


@dataclass
class FoundSources:
    """Where one fetch's files may come from, before the origin: the sources of each lane
    (nearest first; a file goes to lane `i % len(lanes)`), other lanes for the files of
    some versions (`by_version`: an earlier version of the chain, laid out by its own
    trees), and those every file may try after its lane's."""

    lanes: list[list[FetchSource]] = field(default_factory=list)
    rest: list[FetchSource] = field(default_factory=list)
    by_version: dict[int, list[list[FetchSource]]] = field(default_factory=dict)

    def laned(self) -> list[FetchSource]:
        """The sources of every lane, in lane order: the target's, then each version's."""
        every = [self.lanes, *self.by_version.values()]
        return [s for lanes in every for lane in lanes for s in lane]

    def in_order(self) -> list[FetchSource]:
        """Every source once: the lanes' (`laned`), then the rest."""
        seen: list[FetchSource] = []
        for source in [*self.laned(), *self.rest]:
            if source not in seen:
                seen.append(source)
        return seen


class SourcedFetch:
    """Tries `sources` in order for each file; keeps using those that behave."""

    def __init__(
        self,
        sources: Iterable[FetchSource],
        on_fault: Callable[[SourceFault], None] | None = None,
        first: concurrent.futures.Future[FoundSources] | None = None,
        first_wait_s: float = 30.0,
        lanes: list[list[FetchSource]] | None = None,
        by_version: dict[int, list[list[FetchSource]]] | None = None,
    ) -> None:
        # Where the lanes come from (`rest` only at the start: `_sources` is the order).
        self._found = FoundSources(list(lanes or []), list(sources), dict(by_version or {}))
        self._sources = self._found.in_order()
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
        self._lock = threading.RLock()
        # Sources that were once unavailable for a file in this fetch (kept for the others
        # until it happens again).
        self._unavailable: set[FetchSource] = set()
        # Set by `close`: faults after it are the reader stopping under a fetch still
        # running (its client closed), not news about the sources.
        self.closed = False

    @property
    def sources(self) -> list[FetchSource]:
        """The sources still in use, in order. The first use waits (at most `first_wait_s`)
        for sources still being found: use it from a worker thread, never from the event
        loop that finds them."""
        with self._lock:
            if self._first is not None:
                first, self._first = self._first, None
                try:
                    found = first.result(timeout=self.first_wait_s)
                except (TimeoutError, concurrent.futures.CancelledError):
                    first.cancel()
                    log.info("no fetch plan within %.0fs; reading the store", self.first_wait_s)
                except Exception as exc:  # finding them failed: the store serves, as without
                    log.info(
                        "no fetch sources (%s: %s); reading the store", type(exc).__name__, exc
                    )
                else:
                    self._found.lanes = found.lanes + self._found.lanes
                    self._found.by_version = {**found.by_version, **self._found.by_version}
                    self._sources[:0] = [s for s in found.in_order() if s not in self._sources]
            return self._sources

    @property
    def lanes(self) -> int:
        """How many lanes the files are dealt out to (0: one order for every file)."""
        self.sources  # noqa: B018 (the lanes are known once the sources are)
        return len(self._found.lanes)

    def order(self, lane: int | None = None, version: int | None = None) -> list[FetchSource]:
        """The sources still in use for a file of lane `lane` (of `version`: that version's
        lanes where the fetch has them, else the target's): that lane's, then those of no
        lane. Never another lane's: in its lane, a peer of this engine's plan may be a
        descendant, waiting for this very file from this engine."""
        with self._lock:
            sources = list(self.sources)
            own = self._found.by_version.get(version) if version is not None else None
            lanes = own or self._found.lanes
            if lane is None or not lanes:
                return sources
            in_lanes = set(self._found.laned())
            mine = lanes[lane % len(lanes)]
            return [s for s in sources if s in mine or s not in in_lanes]

    def fetch(
        self,
        key: str,
        expected: FileDigest,
        attempts: Attempts | None = None,
        lane: int | None = None,
        held: Held | None = None,
        version: int | None = None,
    ) -> bytes | None:
        """The bytes of `key` from the first sources that deliver them intact, or None.
        `lane`: the file's place among the version's files (its lane's sources go first);
        `version`: the version it belongs to (whose own lanes, if given, are used).

        A source that fails mid-file keeps what it delivered: the next one is asked for the
        rest, from that offset, into the same attempt, so readers forwarding the file read
        on instead of starting over (and their readers after them). Unless its failure
        says those bytes may be wrong (`SourceFailed.suspect`: a peer whose own copy failed
        its digest after it forwarded part of it): then they are thrown away, readers start
        over, and the next source starts from the first byte. Continuing from them made a
        lying peer's bytes travel down the tree and every engine below read the file twice,
        once continued, once whole from the store. The whole is verified
        at the end as always. A whole made of several sources' bytes that does not match is
        thrown away without blaming any of them (which one lied is unknown), and the next
        source starts from the first byte. On None, `held` (when given) holds the leading
        bytes received so far, for the caller to continue from (the origin)."""
        held = held if held is not None else Held()
        held.clear()
        for source in self.order(lane, version):
            sink = attempts.sink() if attempts is not None else None
            start = held.size

            def take(
                chunk: bytes, sink: Callable[[bytes], None] | None = sink, kind: str = source.kind
            ) -> None:
                held.take(chunk, kind)
                if sink is not None:
                    sink(chunk)

            try:
                rest = source.fetch(key, expected.size, take, offset=start)
            except FileNotFoundError:
                continue
            except SourceFailed as exc:
                self._drop(source, key, exc.reason, str(exc), keep=self._first_miss(source, exc))
                if exc.suspect and held.size:
                    # Nothing is continued from bytes that may be wrong: start over, and so
                    # do the readers that were forwarded them.
                    if attempts is not None:
                        attempts.failed()
                    self.reject(held.size)
                    held.clear()
                continue
            # One source from the first byte (the usual case): its own bytes, not a copy.
            data = rest if not start else b"".join(held.chunks)
            fault = self._mismatch(source, key, data, expected)
            if fault is not None:
                if attempts is not None:
                    attempts.failed()
                self.reject(len(data))
                if start:
                    log.warning("%s: the bytes of several sources did not match (%s); "
                                "reading it again from the start", key, fault[1])  # fmt: skip
                else:
                    self._drop(source, key, *fault)
                held.clear()
                continue
            if attempts is not None:
                attempts.verified()
            with self._lock:
                self.bytes_from.update(held.parts)
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

    def count_origin(self, size: int, held: Held | None = None) -> None:
        """Bytes the reader took from the origin store (when no source delivered), after
        the `held` bytes that sources delivered before they failed."""
        with self._lock:
            self.bytes_from["store"] += size
            if held is not None:
                self.bytes_from.update(held.parts)

    def reject(self, size: int) -> None:
        """Bytes received and thrown away (they did not match the origin's record)."""
        with self._lock:
            self.bytes_rejected += size

    def _first_miss(self, source: FetchSource, exc: SourceFailed) -> bool:
        """Whether `source` stays in use after `exc`: only the first time in this fetch that
        it is unavailable for a file (a parent whose own source of one file failed may serve
        the others; one that fails twice is most likely overloaded, and retrying it for
        every file costs each of them a wait)."""
        if exc.reason != "unavailable":
            return False
        with self._lock:
            first = source not in self._unavailable
            self._unavailable.add(source)
        return first

    def _drop(
        self, source: FetchSource, key: str, reason: str, message: str, keep: bool = False
    ) -> None:
        """Record `source`'s fault on `key`; unless `keep`, stop using it for this fetch. A
        source that is only unavailable for this file (busy, or a peer whose own source of it
        failed) is kept for the others: dropping a parent for every file it would serve
        sends them all to the store."""
        fault = SourceFault(source, key, reason, message)
        with self._lock:
            if source in self.sources and not keep:
                self.sources.remove(source)
            self.faults.append(fault)
        log.log(
            logging.DEBUG if self.closed else logging.WARNING,
            "%s fetch source %s (%s): %s",
            "skipped" if keep else "dropped",
            source.location,
            reason,
            message,
        )
        if self.on_fault is not None:
            self.on_fault(fault)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._first is not None:
            self._first.cancel()
        for source in {*self._sources, *(fault.source for fault in self.faults)}:
            source.close()
