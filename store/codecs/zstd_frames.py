"""Decompressing a zstd frame whose size we already know, without trusting its header.

A corrupt or hostile frame could claim any content size; decoders ask for exactly the bytes
the tensor needs and refuse anything else with `CorruptPayload`.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from store.errors import CorruptPayload
from store.tensors import as_buffer


def decompress_exact(
    decompressor: zstandard.ZstdDecompressor,
    frame: np.ndarray | bytes | memoryview,
    size: int,
    what: str,
) -> bytes:
    """Decompress one frame that must hold exactly `size` bytes; `what` names it in errors."""
    frame = as_buffer(frame)
    try:
        claimed = zstandard.frame_content_size(frame)
        if claimed not in (size, -1):
            raise CorruptPayload(
                f"{what} claims {claimed} bytes, expected {size}; it belongs to another "
                "tensor or is corrupt"
            )
        data = decompressor.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"{what} is not a valid zstd frame: {exc}") from None
    if len(data) != size:
        raise CorruptPayload(f"{what} decompresses to {len(data)} bytes, expected {size}")
    return data


class ZstdContexts(threading.local):
    """One compressor and one decompressor per thread.

    zstd contexts are not thread-safe; codec instances are shared module-wide and the
    publisher and the agent encode and decode from thread pools, so each thread lazily
    gets its own pair.
    """

    def __init__(self, level: int, min_match: int = 0) -> None:
        """`min_match`: the shortest match the compressor looks for (0: the level's own)."""
        if min_match:
            params = zstandard.ZstdCompressionParameters(
                compression_level=level, min_match=min_match
            )
            self.compressor = zstandard.ZstdCompressor(compression_params=params)
        else:
            self.compressor = zstandard.ZstdCompressor(level=level)
        self.decompressor = zstandard.ZstdDecompressor()
