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
    """A checksum fed a tensor's bytes in order, stretch by stretch (`checksum_stream`)."""

    def update(self, data: memoryview, /) -> None: ...


def checksum_stream() -> xxhash.xxh3_128:
    """A streaming xxh3-128: fed a tensor's bytes in order, in stretches of any size, its
    `hexdigest()` is `tensor_checksum` of the whole; lets a fold hash each stretch while it
    is still in cache instead of rereading the tensor from memory afterwards."""
    return xxhash.xxh3_128()


def file_checksum(path: str | Path, chunk_bytes: int = 8 << 20) -> str:
    """xxh3-128 hex digest of a file's bytes, read in chunks."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
