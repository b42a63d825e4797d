"""One tensor through a delta codec and back, as the codec tests check it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from store.codecs import workers
from store.codecs.delta import DeltaCodec
from store.tensors import RawTensor


def bf16_tensor(bits: np.ndarray) -> RawTensor:
    return RawTensor("BF16", (bits.size,), bits.astype(np.uint16).view(np.uint8))


def round_trip(codec: DeltaCodec, new: RawTensor, old: RawTensor) -> np.ndarray:
    """`old` patched with `codec`'s payload for `new`; also checks that the codec reports
    exactly the elements that differ, in order."""
    payload = codec.encode_tensor(new, old)
    out = old.data.copy()
    if payload is not None:
        changed = codec.apply_into(out, payload, new.itemsize, "t")
        assert changed is not None
        assert changed.tolist() == np.flatnonzero(new.bits() != old.bits()).tolist()
    return out


def encoded_on_one_and_two_threads(encode: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    """`encode(threads)` run with the codec pools at 1 thread, then at 2 (restored after)."""
    try:
        workers.set_threads(1)
        one = encode(1)
        workers.set_threads(2)
        return one, encode(2)
    finally:
        workers.set_threads(2)
