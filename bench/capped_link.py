"""Bandwidth caps for the fleet benchmark: a modelled network link in the store read path.

Owns `Link` (a first-come-first-served link of a fixed bandwidth: each transfer is queued
behind the ones already on it and takes size / rate seconds) and `CappedObjects`, an
`ObjectStore` adapter that reads through a shared inner store and then holds the calling
thread until the bytes would have crossed both the agent's own link and the store's
egress link (`SharedLink`: one queue for the agents of every swarm process, in shared
memory). Every byte read is counted (`Egress`, shared the same way) so the benchmark can
report store egress per version. It models time only: the bytes are the real ones from
the real S3 server, and writes pass through uncapped (the benchmark's agents only read).
Never used outside `bench/`.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.context import BaseContext

from store.objects.base import Cell, Listing, ObjectStore


class Link:
    """A link of `rate` bytes/s shared by every transfer that reserves it (FIFO), times
    `factor` (a bench may run a phase it does not measure on faster links)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.factor = 1.0
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, size: int, now: float) -> float:
        """Queue `size` bytes behind the transfers already on the link; return when the
        last of them has crossed it (monotonic seconds), or `now` for an uncapped link."""
        if self.rate is None or self.rate <= 0:
            return now
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + size / (self.rate * self.factor)
            return self._free_at


class SharedLink(Link):
    """A `Link` shared by the threads of several processes (the store's egress, which every
    swarm worker's agents read through): its queue lives in shared memory. Hand it to the
    worker processes when they are started (it pickles only then)."""

    def __init__(self, rate: float | None, context: BaseContext) -> None:
        self.rate = rate
        self._shared_free_at = context.Value("d", 0.0, lock=True)
        self._shared_factor = context.Value("d", 1.0, lock=False)

    @property
    def factor(self) -> float:
        return float(self._shared_factor.value)

    @factor.setter
    def factor(self, value: float) -> None:
        self._shared_factor.value = value

    def reserve(self, size: int, now: float) -> float:
        if self.rate is None or self.rate <= 0:
            return now
        free_at = self._shared_free_at
        with free_at.get_lock():
            start = max(now, free_at.value)
            free_at.value = start + size / (self.rate * self.factor)
            return float(free_at.value)


# What a store read was, by its key: the version's tensor shards, its index, or the small
# objects an agent reads to plan and verify (claims, pointers), which do not grow with the
# model but are read by every engine.
KINDS = ("shards", "index", "other")


def kind_of(key: str) -> str:
    if key.endswith(".safetensors"):
        return "shards"
    return "index" if key.endswith(".index.json") else "other"


class Egress:
    """Bytes read from the store, in total and by `KINDS`, over every process it was
    handed to."""

    def __init__(self, context: BaseContext | None = None) -> None:
        context = context or multiprocessing.get_context("spawn")
        self._bytes = context.Value("q", 0, lock=True)
        self._reads = context.Value("q", 0, lock=False)
        self._kinds = context.Array("q", len(KINDS), lock=False)

    @property
    def bytes(self) -> int:
        return int(self._bytes.value)

    @property
    def reads(self) -> int:
        return int(self._reads.value)

    def by_kind(self) -> dict[str, int]:
        with self._bytes.get_lock():
            return {kind: int(self._kinds[i]) for i, kind in enumerate(KINDS)}

    def add(self, size: int, key: str = "") -> None:
        with self._bytes.get_lock():
            self._bytes.value += size
            self._reads.value += 1
            self._kinds[KINDS.index(kind_of(key))] += size


class CappedObjects(ObjectStore):
    """`inner`'s objects as one agent sees them over `link`, behind the store's `egress`."""

    def __init__(self, inner: ObjectStore, link: Link, store_link: Link, egress: Egress) -> None:
        self.inner = inner
        self.url = inner.url
        self.link = link
        self.store_link = store_link
        self.egress = egress

    def _arrive(self, data: bytes, key: str) -> bytes:
        now = time.monotonic()
        done = max(self.store_link.reserve(len(data), now), self.link.reserve(len(data), now))
        self.egress.add(len(data), key)
        # The caller is a worker thread of the agent's fetch (`asyncio.to_thread`): holding
        # it is how a slow link holds a real fetch.
        if done > now:
            time.sleep(done - now)
        return data

    def get(self, key: str) -> bytes:
        return self._arrive(self.inner.get(key), key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._arrive(self.inner.get_range(key, start, length), key)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def list(self, prefix: str) -> Listing:
        return self.inner.list(prefix)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def read_cell(self, key: str) -> Cell:
        cell = self.inner.read_cell(key)
        if cell.data is not None:
            self._arrive(cell.data, key)
        return cell

    def swap_cell(self, key: str, data: bytes, token: object) -> None:
        self.inner.swap_cell(key, data, token)
