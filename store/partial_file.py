"""A file being received, readable by others while its bytes arrive (cut-through forwarding).

A catch-up that serves its peers registers each file it fetches as a `PartialFile` before
the first byte; the fetch writes every chunk into it as it arrives (from a peer, a
distributor or the store; when a source fails mid-file the next one continues from the
same offset into the same `PartialFile`) and then either marks it `verified` (its size and
digest matched what the origin store recorded) or `failed` (bytes that did not match, or
no source left to finish it). Readers (the peer server, on the event loop) read what has arrived so
far and wait for more. Until the file is verified the last byte is held back, so a reader
never completes a transfer of bytes the receiver has not checked itself: a failed file ends
every reader's transfer short, which the reader treats as its source being unavailable and
reads elsewhere. Each attempt at a file is its own `PartialFile`; a failed one never turns
good. Holds bytes in memory only; never writes the cache or the store, never verifies.
"""

from __future__ import annotations

import asyncio
import threading
import time

RECEIVING = "receiving"
VERIFIED = "verified"
FAILED = "failed"


class PartialFile:
    """The bytes of store key `key` (`size` bytes long) received so far."""

    def __init__(self, key: str, size: int) -> None:
        self.key = key
        self.size = size
        self.state = RECEIVING
        self._data = bytearray()
        self._lock = threading.Lock()
        # Readers waiting for news, each with the loop its future belongs to.
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def received(self) -> int:
        """Bytes written so far."""
        with self._lock:
            return len(self._data)

    # ---- the receiving side (a fetch thread) ----------------------------------------------

    def write(self, chunk: bytes) -> None:
        """Bytes that arrived, in order. Past `size` they are dropped (the fetch will fail)."""
        with self._lock:
            if self.state != RECEIVING:
                return
            room = self.size - len(self._data)
            self._data += chunk[: max(0, room)]
        self._wake()

    def verified(self) -> None:
        """The bytes match the origin's size and digest: release the last of them."""
        self._finish(VERIFIED)

    def failed(self) -> None:
        """This attempt failed: every reader's transfer ends short."""
        self._finish(FAILED)

    def _finish(self, state: str) -> None:
        with self._lock:
            if self.state == RECEIVING:
                self.state = state
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle, future)

    # ---- the reading side (the event loop) ------------------------------------------------

    def readable(self) -> int:
        """How many leading bytes a reader may take now: all of them once verified, all but
        the last before."""
        with self._lock:
            if self.state == VERIFIED:
                return len(self._data)
            if self.state == FAILED:
                return 0
            return min(len(self._data), self.size - 1)

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of what has arrived (the caller stays within `readable()`)."""
        with self._lock:
            return bytes(self._data[start:end])

    async def wait(self, beyond: int, timeout_s: float) -> bool:
        """Until more than `beyond` bytes are readable or the file is finished; False if
        nothing changed within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        while True:
            future: asyncio.Future[None] = loop.create_future()
            with self._lock:
                if self.state != RECEIVING:
                    return True
                self._waiters.append((loop, future))
            if self.readable() > beyond:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(future, left)
            except TimeoutError:
                return False
            if self.readable() > beyond or self.state != RECEIVING:
                return True


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
