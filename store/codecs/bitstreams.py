"""Bit-level streams of `sparse-v2`: Rice-coded gaps and values, the Rice parameter, varints.

The per-element loops are compiled (`store.codecs.sparse_kernels`); no Python loop runs per
element here. Bits are packed most significant first (numpy's `packbits` order);
`docs/format.md` §5 specifies them exactly.
This module knows nothing about tensors or payload layout; decoders raise `CorruptPayload`
for streams that do not fit their declared sizes.
"""

from __future__ import annotations

import numpy as np

from store.codecs.sparse_kernels import OK, rice_pack, rice_unpack
from store.codecs.sparse_kernels import rice_parameter as _rice_parameter
from store.errors import CorruptPayload


def rice_parameter(values: np.ndarray, total: int, limit: int = 31) -> int:
    """The Rice parameter r (≤ `limit`) that codes `values` in the fewest bits.

    Candidates sit around log2 of the mean value (`total` / count; the optimum for
    geometric values); the exact cost k(r+1) + Σ(v >> r) is computed on a sample. For gaps,
    Σ(g >> r) ≤ span >> r, so a few huge gaps (clustered changes) cannot blow up the unary
    part.
    """
    return int(_rice_parameter(values, total, limit))


def rice_encode(values: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(low-bit planes, unary stream, unary bit count) of `values` with Rice parameter r.

    Low bits: r planes, least significant first; plane j holds bit j of every value, packed
    8 to a byte most significant first (`ceil(k/8)` bytes per plane). Unary: each quotient
    v >> r as that many zero bits then a one, packed the same way.
    """
    if values.size == 0:
        return np.empty(0, np.uint8), np.empty(0, np.uint8), 0
    low, unary, bits = rice_pack(values, r)
    return low, unary, int(bits)


def rice_decode(
    low: np.ndarray, unary: np.ndarray, unary_bits: int, count: int, r: int, what: str
) -> np.ndarray:
    """Inverse of `rice_encode`: `count` values as uint64 (arithmetic wraps).

    `CorruptPayload` unless the unary stream holds exactly `count` codes, the last ending at
    bit `unary_bits - 1`, and the streams are as long as those sizes need.
    """
    if unary.size * 8 < unary_bits or low.size < r * (-(-count // 8)):
        raise CorruptPayload(f"{what}: its Rice streams are shorter than {count} values need")
    values = np.empty(count, dtype=np.uint64)
    if rice_unpack(low, unary, unary_bits, r, values) != OK:
        raise CorruptPayload(
            f"{what}: its unary stream does not hold {count} codes ending at its last bit "
            f"({unary_bits} bits)"
        )
    return values


def write_varint(value: int, out: bytearray) -> None:
    """Append `value` (≥ 0) as LEB128: 7 bits per byte, high bit = more bytes follow."""
    if value < 0x80:  # most header fields: one byte, without the loop
        out.append(value)
        return
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def read_varint(data: bytes | memoryview, offset: int, what: str) -> tuple[int, int]:
    """The LEB128 integer at `offset` and the offset after it."""
    try:
        first = data[offset]
    except IndexError:
        raise CorruptPayload(f"{what} is truncated inside a varint") from None
    if first < 0x80 and offset >= 0:  # most header fields: one byte, without the loop
        return first, offset + 1
    value = shift = 0
    end = len(data)
    while True:
        if offset >= end:
            raise CorruptPayload(f"{what} is truncated inside a varint")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7
        if shift > 63:
            raise CorruptPayload(f"{what} holds a varint longer than 64 bits")
