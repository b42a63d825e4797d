"""Hypothesis strategies for checkpoints: every dtype a checkpoint holds, odd shapes, and
successor checkpoints that change some elements the way training (and bit noise) does."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from store.tensors import DTYPE_SIZES, RawTensor

CHECKPOINT_DTYPES = ("BF16", "F16", "F32", "F8_E4M3", "U8")

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
names = st.from_regex(r"model\.layers\.[0-9]{1,2}\.[a-z_]{1,8}\.weight", fullmatch=True)


@st.composite
def raw_tensors(draw, dtype=None) -> RawTensor:
    dtype = dtype or draw(st.sampled_from(CHECKPOINT_DTYPES))
    shape = draw(shapes)
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return RawTensor(dtype, shape, data)


@st.composite
def successors(draw, tensor: RawTensor) -> RawTensor:
    """`tensor` with some elements moved by one unit in the last place and some replaced."""
    bits = tensor.bits().copy()
    if bits.size:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        fraction = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
        nudged = rng.random(bits.size) < fraction
        bits[nudged] += bits.dtype.type(1)
        replaced = rng.random(bits.size) < fraction / 4
        bits[replaced] = rng.integers(
            0, np.iinfo(bits.dtype).max, int(replaced.sum()), dtype=bits.dtype
        )
    return RawTensor(tensor.dtype, tensor.shape, bits.view(np.uint8))


@st.composite
def checkpoints(draw, dtype: str | None = None, max_size: int = 4) -> dict[str, RawTensor]:
    keys = draw(st.lists(names, min_size=1, max_size=max_size, unique=True))
    return {key: draw(raw_tensors(dtype)) for key in keys}


@st.composite
def chains(draw, length: int, dtype: str | None = None) -> list[dict[str, RawTensor]]:
    """`length` checkpoints with the same layout, each a successor of the one before."""
    first = draw(checkpoints(dtype))
    out = [first]
    for _ in range(length - 1):
        out.append({k: draw(successors(t)) for k, t in out[-1].items()})
    return out


def same_bits(a: dict[str, RawTensor], b: dict[str, RawTensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].same_layout(b[k]) and np.array_equal(a[k].data, b[k].data) for k in a
    )
