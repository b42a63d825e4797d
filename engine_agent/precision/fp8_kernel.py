"""Compiled (numba) FP8 block conversion: full and incremental, one pass per tensor.

Owns `quantize_full` (a BF16 weight's full conversion, read from its bits), `recode_changes`,
which patches a converted FP8 tensor (codes, 128×128 tile scales and the per-tile thresholds
`engine_agent.precision.incremental` keeps) for a sorted list of changed element positions,
and the E4M3 casts they and the NVFP4 kernel share (`e4m3_code`, and the branch-free
`e4m3_saturating_code` that vectorises).

Every number is computed with the fp32 operations `engine_agent.precision.fp8` runs as torch
ops (IEEE division, clamp to ±448, round-to-nearest-even cast with torch's rules, `amax/448`
scales), so the bytes equal a full conversion's; tests hold `e4m3_code` to torch's cast.
Must never decide when a tensor is converted in full, nor allocate per element beyond one
byte per tile.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_BLOCK = 128
_BLOCK_SHIFT = 7
_E4M3_MAX = np.float32(448.0)
# The E4M3 byte of +448 with the sign bit masked off: the code only a tile's amax element
# can hold while its scale is a normal float.
_E4M3_448 = 0x7E
# A tile whose amax is below this has a subnormal scale; such tiles are always redone whole.
_MIN_NORMAL_AMAX = np.float32(2.0**-126 * 448.0)
# fp32 bit patterns of c10's fp32 → float8_e4m3fn conversion: 480 (from here on the cast
# gives NaN), 2⁻⁶ (the smallest normal E4M3) and 2¹⁴, whose fp32 addition rounds a value
# below 2⁻⁶ to its E4M3 subnormal code in the low bits.
_NAN_FROM = 1087 << 20
_NORMAL_FROM = 121 << 23
_DENORM_MAGIC = 141 << 23
_CHUNK = 4096  # changed elements gathered per step (their scratch stays in L1)
_jit = numba.njit(cache=True, nogil=True)


@intrinsic
def _f32_bits_ir(typingctx: Any, value: Any) -> Any:
    """The bits of an fp32 as uint32: an LLVM bitcast, no memory round trip."""
    if value != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32_ir(typingctx: Any, bits: Any) -> Any:
    """The fp32 whose bits are a uint32."""
    if bits != types.uint32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _divide_ir(typingctx: Any, numerator: Any, denominator: Any) -> Any:
    """fp32 IEEE division as one LLVM `fdiv`: numba's `/` also tests the divisor for zero
    (to raise), a branch per element that keeps a loop from vectorising. Zero divisors
    give inf/NaN as IEEE says, which is what torch's division gives."""
    if numerator != types.float32 or denominator != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fdiv(args[0], args[1])

    return types.float32(types.float32, types.float32), codegen


# Typed as Any: the intrinsics' Python signatures (with `typingctx`) are not their call's.
_f32_bits: Any = _f32_bits_ir
_bits_f32: Any = _bits_f32_ir
_divide: Any = _divide_ir


@_jit
def e4m3_code(value: np.float32) -> np.uint8:
    """The float8_e4m3fn byte torch's cast gives an fp32 value in [-448, 448] or NaN:
    nearest-even, subnormals rounded through c10's fp32 addition, NaN as 0x7F with its sign.
    Callers clamp first (torch's build saturates beyond 448 where c10 gives NaN)."""
    bits = np.int64(_f32_bits(value))
    sign = bits & 0x80000000
    magnitude = bits ^ sign
    if magnitude >= _NAN_FROM:
        code = np.int64(0x7F)
    elif magnitude < _NORMAL_FROM:
        magic = _bits_f32(np.uint32(_DENORM_MAGIC))
        summed = np.int64(_f32_bits(_bits_f32(np.uint32(magnitude)) + magic))
        code = (summed - _DENORM_MAGIC) & 0xFF
    else:
        odd = (magnitude >> 20) & 1
        code = ((magnitude + ((7 - 127) << 23) + 0x7FFFF + odd) >> 20) & 0xFF
    return np.uint8(code | (sign >> 24))


def _e4m3_table() -> np.ndarray:
    """fp32 value of every float8_e4m3fn byte (NaN for 0x7F/0xFF), exact."""
    table = np.empty(256, np.float32)
    for code in range(256):
        exponent, mantissa = (code >> 3) & 0xF, code & 7
        if exponent == 0:
            value = mantissa * 2.0**-9
        else:
            value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        table[code] = np.nan if code & 0x7F == 0x7F else (-value if code & 0x80 else value)
    return table


# A table rather than arithmetic: `2.0 ** e` in the inner loop cost ~20 ns per group.
_E4M3_VALUES = _e4m3_table()


@_jit
def e4m3_value(code: np.uint8) -> np.float32:
    """fp32 value of a float8_e4m3fn byte (exact)."""
    value: np.float32 = _E4M3_VALUES[code]
    return value


@_jit
def bf16_value(bits: np.uint16) -> np.float32:
    value: np.float32 = _bits_f32(np.uint32(np.uint32(bits) << 16))
    return value


@_jit
def _encode(value: np.float32, scale: np.float32) -> np.uint8:
    y = value / scale
    if y == y:  # torch's clamp keeps NaN
        y = min(max(y, -_E4M3_MAX), _E4M3_MAX)
    return e4m3_code(y)


@_jit
def _redo_tile(
    weight: np.ndarray,
    rows: int,
    cols: int,
    tile: int,
    tiles_per_row: int,
    q: np.ndarray,
    scale: np.ndarray,
    threshold: np.ndarray,
) -> None:
    r0 = (tile // tiles_per_row) * _BLOCK
    c0 = (tile % tiles_per_row) * _BLOCK
    r1 = min(r0 + _BLOCK, rows)
    c1 = min(c0 + _BLOCK, cols)
    amax = np.float32(0.0)
    for r in range(r0, r1):
        for c in range(c0, c1):
            a = abs(bf16_value(weight[r * cols + c]))
            if a > amax or a != a:
                amax = a
    s = amax / _E4M3_MAX if amax > 0 else np.float32(1.0)
    scale[tile] = s
    normal = amax >= _MIN_NORMAL_AMAX and amax < np.inf
    threshold[tile] = amax if normal or amax == 0 else np.float32(-1.0)
    for r in range(r0, r1):
        for c in range(c0, c1):
            q[r * cols + c] = _encode(bf16_value(weight[r * cols + c]), s)


@_jit
def _tile_top_bits(weight: np.ndarray, rows: int, cols: int, tile: int, tiles_per_row: int) -> int:
    """Largest BF16 magnitude bits in a tile: its amax, as bits (magnitudes order as their
    bits do; a NaN's bits exceed every number's)."""
    r0 = (tile // tiles_per_row) * _BLOCK
    c0 = (tile % tiles_per_row) * _BLOCK
    top = 0
    for r in range(r0, min(r0 + _BLOCK, rows)):
        row = weight[r * cols + c0 : r * cols + min(c0 + _BLOCK, cols)]
        for c in range(row.size):
            top = max(top, row[c] & 0x7FFF)
    return top


@_jit
def _recode_changes(
    weight: np.ndarray,
    rows: int,
    cols: int,
    positions: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    threshold: np.ndarray,
) -> int:
    tiles_per_row = scale.size // max(1, (rows + _BLOCK - 1) // _BLOCK)
    suspect = np.zeros(scale.size, np.uint8)
    bits = np.empty(_CHUNK, np.uint16)
    old = np.empty(_CHUNK, np.uint8)
    row_start = np.int64(0)  # the row of the last position, kept as positions rise
    row_tiles = 0  # tile index of that row's first tile
    for start in range(0, positions.size, _CHUNK):
        stop = min(start + _CHUNK, positions.size)
        # Gather first: independent loads overlap their cache misses, which the recoding
        # loop (a dependent chain per element) would otherwise wait for one by one.
        for i in range(start, stop):
            p = positions[i]
            if p < 0 or p >= weight.size:
                raise IndexError("a changed position lies outside the tensor")
            bits[i - start] = weight[p]
            old[i - start] = q[p]
        for i in range(start, stop):
            p = positions[i]
            if p - row_start >= cols or p < row_start:
                # A division only when the row changes (positions are sorted).
                r = p // cols
                row_start = r * cols
                row_tiles = (r >> _BLOCK_SHIFT) * tiles_per_row
            tile = row_tiles + ((p - row_start) >> _BLOCK_SHIFT)
            value = bf16_value(bits[i - start])
            # `not <=` so that a NaN (outside the contract) still marks its tile; a code
            # of ±448 may have been the tile's amax element, which can move the scale down.
            if not abs(value) <= threshold[tile] or (old[i - start] & 0x7F) == _E4M3_448:
                suspect[tile] = 1
            # Coded with the tile's scale even when suspect: if its amax stands, that is
            # the code; if not, the tile is redone whole below.
            q[p] = _encode(value, scale[tile])
    redone = 0
    for tile in range(scale.size):
        if suspect[tile]:
            # The amax from the bits first: most suspects keep theirs (the ±448 code was
            # not the amax element, or it is tied), and then the codes above stand.
            top = _tile_top_bits(weight, rows, cols, tile, tiles_per_row)
            if (
                top < 0x7F80
                and threshold[tile] >= 0
                and bf16_value(np.uint16(top)) == threshold[tile]
            ):
                continue
            _redo_tile(weight, rows, cols, tile, tiles_per_row, q, scale, threshold)
            redone += 1
    return redone


def recode_changes(
    weight: np.ndarray,
    shape: tuple[int, int],
    positions: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    threshold: np.ndarray,
) -> int:
    """Patch FP8 codes `q` (uint8, flat), tile scales and thresholds (fp32, flat) in place
    for BF16 `weight` (uint16 bits, flat, shape `shape`) whose elements at the sorted flat
    `positions` changed; return how many tiles were requantized whole."""
    rows, cols = shape
    return int(_recode_changes(weight, rows, cols, positions, q, scale, threshold))


# fp32 magnitude bits of 448: from here on (inf included) the clamp before the cast gives 448.
_E4M3_MAX_BITS = 0x43E00000
_F32_INF_BITS = 0x7F800000


# `e4m3_code`'s rebias and round-half-up of a normal value's fp32 bits, as a uint32 addend.
_NORMAL_ADDEND = (((7 - 127) << 23) + 0x7FFFF) % (1 << 32)


@numba.njit(cache=True, nogil=True, inline="always")
def e4m3_saturating_code(y: np.float32) -> np.uint8:
    """The float8_e4m3fn byte of any fp32 clamped to ±448 first (`_encode`'s clamp, then
    `e4m3_code`), without branches so that a loop over a row of quotients vectorises: every
    case is computed and the right one selected.

    In uint32 throughout, each result narrowed back: numba widens integer arithmetic to 64
    bits and the vectoriser follows the widest type, which gave four lanes to an AVX2
    register (eight to an AVX-512 one) instead of eight (sixteen). Where the normal case is
    selected its sum is positive and below 2³¹, so the wrapped uint32 sum has the bits the
    int64 one has; the other cases' garbage is never selected."""
    bits = _f32_bits(y)
    magnitude = np.uint32(bits & np.uint32(0x7FFFFFFF))
    odd = np.uint32(np.uint32(magnitude >> np.uint32(20)) & np.uint32(1))
    normal = np.uint32(np.uint32(magnitude + np.uint32(_NORMAL_ADDEND)) + odd) >> np.uint32(20)
    magic = _bits_f32(np.uint32(_DENORM_MAGIC))
    subnormal = np.uint32(_f32_bits(_bits_f32(magnitude) + magic) - np.uint32(_DENORM_MAGIC))
    code = subnormal if magnitude < np.uint32(_NORMAL_FROM) else np.uint32(normal)
    code = np.uint32(_E4M3_448) if magnitude >= np.uint32(_E4M3_MAX_BITS) else code
    code = np.uint32(0x7F) if magnitude > np.uint32(_F32_INF_BITS) else code
    sign = np.uint32(np.uint32(bits >> np.uint32(24)) & np.uint32(0x80))
    return np.uint8(np.uint32(code & np.uint32(0xFF)) | sign)


@_jit
def _quantize_full(
    weight: np.ndarray,
    rows: int,
    cols: int,
    q: np.ndarray,
    scale: np.ndarray,
    column_top: np.ndarray,
    column_scale: np.ndarray,
) -> None:
    tiles_per_row = (cols + _BLOCK - 1) >> _BLOCK_SHIFT
    # Inner loops run over whole rows (rows of 2-D arrays: contiguous to the compiler, which
    # a slice of a flat array is not) with a per-column operand, so that they vectorise.
    for r0 in range(0, rows, _BLOCK):
        r1 = min(r0 + _BLOCK, rows)
        # Each tile's amax as its largest BF16 magnitude bits (magnitudes order as their
        # bits do; a NaN's bits exceed every number's): integer lanes, no fp32 copy.
        column_top[:] = 0
        for r in range(r0, r1):
            row = weight[r]
            for c in range(cols):
                column_top[c] = max(column_top[c], row[c] & np.uint16(0x7FFF))
        block_scales = scale[(r0 >> _BLOCK_SHIFT) * tiles_per_row :][:tiles_per_row]
        for t in range(tiles_per_row):
            top = np.uint16(0)
            for c in range(t * _BLOCK, min(t * _BLOCK + _BLOCK, cols)):
                top = max(top, column_top[c])
            # `fp8.scales_from_amax`: amax/448, 1.0 for a zero tile or a NaN amax.
            amax = bf16_value(top)
            s = amax / _E4M3_MAX if amax > 0 else np.float32(1.0)
            block_scales[t] = s
            column_scale[t * _BLOCK : t * _BLOCK + _BLOCK] = s
        # The codes: `fp8.encode`'s IEEE division per element, then the cast.
        for r in range(r0, r1):
            row, out = weight[r], q[r]
            for c in range(cols):
                out[c] = e4m3_saturating_code(_divide(bf16_value(row[c]), column_scale[c]))


def quantize_full(weight: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Full FP8 block conversion of BF16 `weight` (uint16 bits, flat, shape `shape`) in one
    compiled pass per 128-row block row: (codes uint8 `[N·K]`, tile scales fp32
    `[⌈N/128⌉·⌈K/128⌉]`), the bytes `fp8.quantize_fp8_block` gives as torch ops."""
    rows, cols = shape
    tiles_per_row = (cols + _BLOCK - 1) >> _BLOCK_SHIFT
    q = np.empty(rows * cols, np.uint8)
    scale = np.empty(((rows + _BLOCK - 1) >> _BLOCK_SHIFT) * tiles_per_row, np.float32)
    column_scale = np.empty(tiles_per_row * _BLOCK, np.float32)
    _quantize_full(
        weight.reshape(rows, cols), rows, cols, q.reshape(rows, cols), scale,
        np.empty(cols, np.uint16), column_scale,
    )  # fmt: skip
    return q, scale
