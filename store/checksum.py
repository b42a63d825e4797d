"""Tensor checksums: xxh3-128 of a tensor's bytes, as Stitch records them.

Stitch writes `xxhash.xxh3_128(bytes).hexdigest()`: 32 lowercase hex characters of the
canonical (big-endian) digest. This module only hashes; it never decides what to do on a
mismatch (callers raise `ChecksumMismatch`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from store.tensors import as_buffer

CHECKSUM_FORMAT = "xxh3-128"


def tensor_checksum(data: np.ndarray | bytes | bytearray | memoryview) -> str:
    """xxh3-128 hex digest (32 lowercase hex characters) of the bytes of `data`."""
    if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return xxhash.xxh3_128_hexdigest(as_buffer(data))


class Digest(Protocol):
    """A checksum fed a tensor's bytes in order, stretch by stretch (`TensorDigest`)."""

    def update(self, data: memoryview, /) -> None: ...


class TensorDigest:
    """`tensor_checksum` of a tensor of `nbytes` bytes fed in order, in stretches of any
    size: a fold hashes each stretch while it is still in cache instead of rereading the
    tensor from memory afterwards. A tensor fed whole in one stretch (most are) is hashed
    in one call, which runs ~1.4x faster than xxh3's streaming state on cached bytes; fed
    nothing, the digest is that of no bytes, which no nonempty tensor's checksum matches.
    """

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes
        self._whole: str | None = None
        self._stream: xxhash.xxh3_128 | None = None

    def update(self, data: memoryview, /) -> None:
        if self._whole is None and self._stream is None and data.nbytes == self._nbytes:
            self._whole = xxhash.xxh3_128_hexdigest(data)
            return
        if self._stream is None:
            if self._whole is not None:
                raise ValueError(f"a tensor of {self._nbytes} bytes was fed more than that")
            self._stream = xxhash.xxh3_128()
        self._stream.update(data)

    def hexdigest(self) -> str:
        if self._whole is not None:
            return self._whole
        return (self._stream or xxhash.xxh3_128()).hexdigest()


class BlocksInOrder:
    """Feeds a digest a tensor's blocks in block order while they finish in any order on a
    pool: whoever finishes a block feeds the run of finished blocks from the first one not
    yet fed, while their bytes are in cache. Nobody waits on another block, so a block that
    fails or is cancelled cannot hang the pool; it only leaves the digest short."""

    def __init__(self, digest: Digest, blocks: int, block_bytes: Callable[[int], memoryview]):
        self._digest = digest
        self._block_bytes = block_bytes
        self._finished = [False] * blocks
        self._next = 0  # the first block not yet fed
        self._lock = threading.Lock()

    def finished(self, index: int) -> None:
        with self._lock:
            self._finished[index] = True
            while self._next < len(self._finished) and self._finished[self._next]:
                self._digest.update(self._block_bytes(self._next))
                self._next += 1


def file_checksum(path: str | Path, chunk_bytes: int = 8 << 20) -> str:
    """xxh3-128 hex digest of a file's bytes, read in chunks."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
