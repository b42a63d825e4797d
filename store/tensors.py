"""Raw tensors: a safetensors dtype code, a shape and the little-endian bytes, without torch.

The codecs, the store and the control plane handle checkpoints as bytes; only
`store.torch_bridge` converts to and from torch. This module must never import torch.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from store.errors import TensorMismatch

# Bytes per element for every safetensors dtype code Tether stores. Sub-byte codes (F4, F6_*)
# pack several elements per byte and are left out on purpose: no checkpoint we serve holds them.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

# The unsigned integer type of each element width: codecs compare and patch elements as bits,
# so NaN payloads and -0.0 survive exactly.
ELEMENT_BITS: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a safetensors dtype code; `TensorMismatch` for one we don't store."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise TensorMismatch(
            f"dtype {dtype!r} is not supported: expected one of {sorted(DTYPE_SIZES)}"
        ) from None


@dataclass(frozen=True)
class RawTensor:
    """One tensor as safetensors stores it: dtype code, shape, C-order little-endian bytes.

    `data` is a 1-D uint8 array of exactly `nbytes` bytes; it may be a read-only view into a
    larger buffer (a loaded shard), so never write into a tensor you did not allocate.
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    # Set by the fold on the tensors it patched: where they differ from the tensor they were
    # folded from, so that consumers (incremental conversion) need not compare the two.
    changed: ChangedElements | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        size = dtype_size(self.dtype)
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise TensorMismatch(f"shape {self.shape!r} must be a tuple of non-negative ints")
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise TensorMismatch(
                f"tensor data must be a 1-D uint8 array, got {self.data.dtype} "
                f"with {self.data.ndim} dimensions"
            )
        expected = math.prod(self.shape) * size
        if self.data.size != expected:
            raise TensorMismatch(
                f"{self.dtype}{list(self.shape)} needs {expected} bytes, got {self.data.size}"
            )

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def bits(self) -> np.ndarray:
        """The elements as unsigned integers of the element's width (a view, no copy)."""
        return self.data.view(ELEMENT_BITS[self.itemsize])

    def same_layout(self, other: RawTensor) -> bool:
        return self.dtype == other.dtype and self.shape == other.shape

    @classmethod
    def from_bytes(cls, dtype: str, shape: tuple[int, ...], data: bytes | bytearray) -> RawTensor:
        return cls(dtype, tuple(shape), np.frombuffer(data, dtype=np.uint8))


@dataclass(frozen=True)
class ChangedElements:
    """The elements of a tensor that may differ from `base`'s (a superset is allowed).

    Holds the base weakly: a version must not keep every earlier version alive.
    """

    base: weakref.ref[RawTensor]
    positions: np.ndarray  # sorted flat element indices, int64

    def relative_to(self, base: RawTensor) -> np.ndarray | None:
        """The positions if `base` is the very tensor they were found against, else None."""
        return self.positions if self.base() is base else None


def total_bytes(tensors: Mapping[str, RawTensor]) -> int:
    """Sum of `nbytes` over a mapping of tensors (the checkpoint's size)."""
    return sum(t.nbytes for t in tensors.values())


def as_buffer(data: np.ndarray | bytes | bytearray | memoryview) -> memoryview:
    """`data`'s bytes as a memoryview, without a copy (an array must be C-contiguous)."""
    return data.data if isinstance(data, np.ndarray) else memoryview(data)
