"""Tensor checksums: xxh3-128 of a tensor's bytes, as Stitch records them.

Stitch writes `xxhash.xxh3_128(bytes).hexdigest()`: 32 lowercase hex characters of the
canonical (big-endian) digest. This module only hashes; it never decides what to do on a
mismatch (callers raise `ChecksumMismatch`).
"""

from __future__ import annotations

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


def file_checksum(path: str | Path, chunk_bytes: int = 8 << 20) -> str:
    """xxh3-128 hex digest of a file's bytes, read in chunks."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
