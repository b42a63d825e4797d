"""Damaged payloads for codec tests: every truncation, and one flipped byte at a time.

A decoder must refuse a truncated payload with `CorruptPayload`, and a flipped byte either
with `CorruptPayload` or by producing bytes the target checksum then rejects; nothing else
may escape it.
"""

from __future__ import annotations

import numpy as np
import pytest

from store.codecs.delta import DeltaCodec
from store.errors import CorruptPayload
from store.tensors import RawTensor


def assert_every_truncation_refused(codec: DeltaCodec, payload: np.ndarray, old: RawTensor):
    for cut in range(payload.size):
        with pytest.raises(CorruptPayload):
            codec.apply_into(old.data.copy(), payload[:cut], old.itemsize, "t")


def flip_outcomes(
    codec: DeltaCodec, payload: np.ndarray, new: RawTensor, old: RawTensor
) -> tuple[int, int]:
    """(flips refused, flips that decoded to wrong bytes), one byte XOR 0x55 at a time."""
    refused = wrong = 0
    for at in range(payload.size):
        bad = payload.copy()
        bad[at] ^= 0x55
        out = old.data.copy()
        try:
            codec.apply_into(out, bad, old.itemsize, "t")
        except CorruptPayload:
            refused += 1
            continue
        wrong += not np.array_equal(out, new.data)
    return refused, wrong
