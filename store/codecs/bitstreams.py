"""Bit-level streams of `sparse-v2`: Rice-coded gaps, packed fixed-width fields, varints.

Everything is vectorised numpy (packbits/unpackbits, cumsum, scatter); no per-element Python
loop runs here, so the cost per changed element is a few numpy passes. Bits are packed most
significant first (numpy's `packbits` order); `docs/format.md` §5 specifies them exactly.
This module knows nothing about tensors or payload layout; decoders raise `CorruptPayload`
for streams that do not fit their declared sizes.
"""

from __future__ import annotations

import numpy as np

from store.errors import CorruptPayload

_SAMPLE = 1 << 16  # gaps inspected to pick the Rice parameter


def rice_parameter(values: np.ndarray, total: int, limit: int = 31) -> int:
    """The Rice parameter r (≤ `limit`) that codes `values` in the fewest bits.

    Candidates sit around log2 of the mean value (`total` / count; the optimum for
    geometric values); the exact cost k(r+1) + Σ(v >> r) is computed on a sample. For gaps,
    Σ(g >> r) ≤ span >> r, so a few huge gaps (clustered changes) cannot blow up the unary
    part.
    """
    k = int(values.size)
    if k == 0:
        return 0
    centre = max(0, int(np.log2(max(total / k, 1.0))))
    sample = values[:: max(1, k // _SAMPLE)].astype(np.uint64)
    best, best_cost = 0, None
    for r in range(max(0, centre - 3), min(centre + 2, limit) + 1):
        cost = sample.size * (r + 1) + int((sample >> np.uint64(r)).sum())
        if best_cost is None or cost < best_cost:
            best, best_cost = r, cost
    return best


def rice_encode(values: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(low-bit planes, unary stream, unary bit count) of `values` with Rice parameter r."""
    unary, bits = unary_stream(values >> values.dtype.type(r))
    return pack_fields(values, r), unary, bits


def rice_decode(
    low: np.ndarray, unary: np.ndarray, unary_bits: int, count: int, r: int, what: str
) -> np.ndarray:
    """Inverse of `rice_encode`: `count` values as uint64 (arithmetic wraps, never raises)."""
    quotients = read_unary(unary, unary_bits, count, what).view(np.uint64)
    values = unpack_fields(low, count, r, np.dtype(np.uint64))
    quotients <<= np.uint64(r)
    values += quotients
    return values


def pack_fields(values: np.ndarray, width: int) -> np.ndarray:
    """The low `width` bits of each value as `width` bit planes, least significant first.

    Plane j holds bit j of every value, packed 8 to a byte (`ceil(k/8)` bytes per plane).
    Planes, not interleaved fields: each is a few contiguous numpy passes, where splitting
    interleaved fields needs a k x width matrix (ten times slower).
    """
    if width == 0 or values.size == 0:
        return np.empty(0, dtype=np.uint8)
    # packbits on a bool array is ~8x faster than on wider ints.
    bit = values.dtype.type
    planes = [np.packbits((values & bit(1 << j)).astype(bool)) for j in range(width)]
    return np.concatenate(planes)


def unpack_fields(stream: np.ndarray, count: int, width: int, dtype: np.dtype) -> np.ndarray:
    """Inverse of `pack_fields`: `count` unsigned values of `width` bits, as `dtype`."""
    values = np.zeros(count, dtype=dtype)
    plane_bytes = -(-count // 8)
    scratch = np.empty(count, dtype=dtype)
    for j in range(width):
        bits = np.unpackbits(stream[j * plane_bytes : (j + 1) * plane_bytes], count=count)
        np.left_shift(bits, dtype.type(j), out=scratch, dtype=dtype)
        values |= scratch
    return values


def unary_stream(quotients: np.ndarray) -> tuple[np.ndarray, int]:
    """Each quotient q as q zero bits then a one; returns (packed bytes, bit count)."""
    ends = np.cumsum(quotients.astype(np.int64) + 1) - 1
    count = int(ends[-1]) + 1
    bits = np.zeros(count, dtype=bool)
    bits[ends] = True
    return np.packbits(bits), count


def read_unary(stream: np.ndarray, bit_count: int, count: int, what: str) -> np.ndarray:
    """Inverse of `unary_stream`: `count` quotients (int64) from `bit_count` bits."""
    if stream.size * 8 < bit_count:
        raise CorruptPayload(f"{what}: its unary stream is shorter than {bit_count} bits")
    # flatnonzero on a bool view is ~10x faster than on the uint8 unpackbits returns.
    ends = np.flatnonzero(np.unpackbits(stream, count=bit_count).view(bool))
    if ends.size != count or (count and int(ends[-1]) != bit_count - 1):
        raise CorruptPayload(
            f"{what}: its unary stream holds {ends.size} codes in {bit_count} bits, "
            f"expected {count} ending at the last bit"
        )
    quotients = np.diff(ends, prepend=-1)
    quotients -= 1
    return quotients


def write_varint(value: int, out: bytearray) -> None:
    """Append `value` (≥ 0) as LEB128: 7 bits per byte, high bit = more bytes follow."""
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
    value = shift = 0
    while True:
        if offset >= len(data):
            raise CorruptPayload(f"{what} is truncated inside a varint")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7
        if shift > 63:
            raise CorruptPayload(f"{what} holds a varint longer than 64 bits")
