"""Capped capture of a child's output: keep the head and the tail, count everything.

A `CappedStream` never holds more than twice its keep size, however much is written; the
reader keeps draining past the cap so the child never blocks on a full pipe. It never kills
anything itself: the caller watches `total` against its hard cap.
"""

from __future__ import annotations

import io
import threading
from typing import IO, cast

TRUNCATION_MARK = b"\n[... %d bytes omitted ...]\n"


class CappedStream:
    """The first and last `keep` bytes of a byte stream, and its total length."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.total = 0
        self._head = bytearray()
        self._tail = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > self.keep:
                del self._tail[: len(self._tail) - self.keep]

    @property
    def truncated(self) -> bool:
        return self.total > len(self._head) + len(self._tail)

    def value(self) -> bytes:
        """Head and tail, with a marker saying how much was dropped between them."""
        if not self.truncated:
            return bytes(self._head + self._tail)
        omitted = self.total - len(self._head) - len(self._tail)
        return bytes(self._head) + TRUNCATION_MARK % omitted + bytes(self._tail)


def cap_bytes(data: bytes, keep: int) -> tuple[bytes, bool]:
    """`data` reduced to its head and tail as a `CappedStream` would keep it."""
    stream = CappedStream(keep)
    stream.feed(data)
    return stream.value(), stream.truncated


def drain_in_thread(
    pipe: IO[bytes], stream: CappedStream, on_chunk: threading.Event
) -> threading.Thread:
    """Read `pipe` to EOF into `stream` on a daemon thread; set `on_chunk` after each read
    and at EOF (the child closing its output is usually the child exiting: the supervisor
    wakes at once instead of at its next poll)."""

    # A Popen pipe is buffered (bufsize -1), so it has read1: whatever is available, <= n.
    reader = cast(io.BufferedReader, pipe)

    def pump() -> None:
        with reader:
            while chunk := reader.read1(65536):
                stream.feed(chunk)
                on_chunk.set()
        on_chunk.set()

    thread = threading.Thread(target=pump, name="sandbox-output", daemon=True)
    thread.start()
    return thread
