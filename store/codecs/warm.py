"""Warming the decoders before the first catch-up needs them.

A process's first fold pays once for what later folds get for free: importing the codecs
(numba among them) and loading each compiled kernel from numba's on-disk cache, or
compiling it when the cache is cold. In an engine agent that first fold runs while the
engine serves, in threads sharing the GIL with the proxy and the heartbeats, and it makes
the first version late by that much. `warm()` pays it up front: it encodes a small delta
of each canonical dtype and folds it back, in memory, through the codec a trainer publishes
with by default. Never touches a store or the network.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from store.tensors import ELEMENT_BITS, RawTensor, dtype_size

# Dtypes a published checkpoint holds: BF16 weights, F32 norms or router tables.
WARM_DTYPES = ("BF16", "F32")
# Enough elements that the codec plans several blocks of each tensor.
_ELEMENTS = 1 << 16
# (share of elements changed, how far each moves in units in the last place): an RL step's
# few small moves and a warm-up's many, and changes too large to code as steps. Each takes
# its own kernels: the steps' and the XOR patterns'.
_CHANGES = ((0.005, 2), (0.3, 2), (0.05, 1 << 12))
# A norm's or a bias's few elements: small tensors are coded together, from other buffers.
_SMALL = 64
# An optimizer's step: values under this magnitude move by one ulp, larger ones stay (a
# step of lr·~1 changes a value only where it exceeds half the value's ulp). Changes that
# follow the base's values are coded by class (sparse-v3), with kernels of their own, and
# classes (binades) where nearly every value moved by their complement: three binades here.
_SMALL_VALUES = 2.0**-6


def warm(dtypes: Sequence[str] = WARM_DTYPES, codec: str = "sparse") -> float:
    """Encode and fold back a small delta of each of `dtypes` with `codec`; the seconds it
    took. The fold verifies its result as a catch-up does, so a codec that cannot fold what
    it wrote fails here (`store.errors`), before any version depends on it."""
    from store.codecs import decode_version, encode_version

    started = time.perf_counter()
    rng = np.random.default_rng(0)
    base: dict[str, RawTensor] = {}
    target: dict[str, RawTensor] = {}
    for dtype in dtypes:
        width = ELEMENT_BITS[dtype_size(dtype)]
        # Positive finite values of a trained weight's magnitudes (2^-9 to 2^-4), as bits.
        values = rng.uniform(2.0**-9, 2.0**-4, _ELEMENTS).astype("<f4").view("<u4")
        bits = (values >> 16 if width.itemsize == 2 else values).astype(width)
        moves = {}
        for share, ulps in _CHANGES:
            moving = rng.random(_ELEMENTS) < share
            moves[f"{share}.{ulps}"] = bits + moving * rng.integers(1, ulps + 1, _ELEMENTS)
        moves["step"] = np.where(values < np.float32(_SMALL_VALUES).view("<u4"), bits + 1, bits)
        for case, moved in moves.items():
            base[f"{dtype}.{case}"] = RawTensor(dtype, bits.shape, bits.view(np.uint8))
            target[f"{dtype}.{case}"] = RawTensor(
                dtype, bits.shape, moved.astype(width).view(np.uint8)
            )
        small = bits[:_SMALL].copy()
        small[::3] += 1
        base[f"{dtype}.small"] = RawTensor(dtype, small.shape, bits[:_SMALL].view(np.uint8))
        target[f"{dtype}.small"] = RawTensor(dtype, small.shape, small.view(np.uint8))
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    decode_version(files, base)
    return time.perf_counter() - started
