"""The `xor` codec: Stitch's delta, byte for byte.

Payload = zstd frame (level 1, one-shot, content size recorded, no frame checksum) of
`target_bytes XOR base_bytes` over the whole tensor. A tensor whose XOR is all zero is
omitted. Applying XOR is an involution, so a payload must be applied exactly once, to exactly
its base; the target checksum catches any other use.
"""

from __future__ import annotations

import numpy as np

from store.checksum import Digest
from store.codecs.zstd_frames import ZstdContexts, decompress_exact
from store.tensors import ELEMENT_BITS, RawTensor

# Stitch's trainer compresses with `ZstdCompressor(level=1).compress(...)`.
ZSTD_LEVEL = 1


class XorCodec:
    name = "xor"
    delta_encoding = "xor"

    def __init__(self) -> None:
        self._zstd = ZstdContexts(ZSTD_LEVEL)

    def encode_tensor(self, target: RawTensor, base: RawTensor) -> np.ndarray | None:
        diff = np.bitwise_xor(target.data, base.data)
        if not diff.any():
            return None
        return np.frombuffer(self._zstd.compressor.compress(diff), dtype=np.uint8)

    def apply_into(
        self,
        out: np.ndarray,
        payload: np.ndarray,
        itemsize: int,
        name: str,
        source: np.ndarray | None = None,
        digest: Digest | None = None,
    ) -> np.ndarray:
        what = f"xor payload of {name!r}"
        diff = np.frombuffer(
            decompress_exact(self._zstd.decompressor, payload, out.size, what), dtype=np.uint8
        )
        # With `source` (the previous state; `out` uninitialised) one pass copies and XORs.
        np.bitwise_xor(out if source is None else source, diff, out=out)
        if digest is not None:
            digest.update(out.data)
        # The changed elements are the non-zero elements of the XOR: one pass over it, in
        # place of a diff of the two versions downstream.
        changed: np.ndarray = np.flatnonzero(diff.view(ELEMENT_BITS[itemsize]))
        return changed
