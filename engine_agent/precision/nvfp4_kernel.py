"""The compiled inner loops of NVFP4 encoding: per-group amax, E2M1 coding plus packing,
the incremental recoding of the groups a change touched, and a BF16 weight's full
conversion in one division-free pass (`quantize_full`, coding with the same per-scale
bounds as the incremental recoder).

Owns numba kernels over fp32 16-element groups `[G, 16]` and, for incremental conversion,
`recode_groups` over a BF16 tensor and sorted changed positions. A chain of torch
elementwise ops (abs, seven comparisons and adds, sign, pack) reads and writes the chunk
about twenty times, which held a full conversion near 0.3 GB/s per core; one fused pass
per group keeps the 16 values in registers and runs at several times that.

The kernels reproduce `nvfp4.e2m1_codes` and `nvfp4.pack_nibbles` bit for bit: the
division is the same correctly rounded fp32 IEEE division torch runs (no fastmath), the
clamp keeps NaN as torch's does, and the code is the same count of the same bounds with
the same tie rules. `recode_groups` also computes group scales as `nvfp4.group_scales`
does, with `fp8_kernel.e4m3_code` (held to torch's cast by the tests) for the E4M3 cast.
`recode_groups` keeps a group's scale byte when its new amax still maps to it (the common
case of a sparse step) and then codes only the changed elements, each into its nibble; a
group whose scale moves is recoded whole. `tests/engine_agent/test_precision.py` checks
them against the torch reference on every BF16 bit pattern. Must never choose a global
scale (that is the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine_agent.precision.fp8_kernel import bf16_value, e4m3_code, e4m3_value

_GROUP = 16
# The E2M1 rounding bounds as fp32 (each exact), compared without widening to fp64.
_B025, _B075, _B125, _B175 = np.float32(0.25), np.float32(0.75), np.float32(1.25), np.float32(1.75)
_B250, _B350, _B500 = np.float32(2.5), np.float32(3.5), np.float32(5.0)
_MIN_SCALE = np.float32(2.0**-9)  # `nvfp4.E4M3_MIN_SUBNORMAL`
_MAX_SCALE = np.float32(448.0)
_CHUNK = 512  # distinct groups gathered per step (their scratch stays in L1)
# Positions ahead of the gather whose group's three cache lines are prefetched. A prefetch
# retires at once, so far more misses are in flight than loads alone keep waiting (A/B on
# 24 tensors of 3072×1024 at 0.25 %, interleaved: 12–28 % less time per changed group).
_AHEAD = 64
_TOPS_PER_STEP = 512  # groups whose amax a full conversion finds per step (scratch in L1)
# cache=True: the compiled code is kept on disk, so each process (engine agents, tests)
# pays the ~1 s compilation once per machine rather than at every first conversion.
_jit = numba.njit(cache=True, nogil=True)


def _group_amax_py(values: np.ndarray, out: np.ndarray) -> None:
    for g in range(values.shape[0]):
        m = np.float32(0.0)
        for i in range(_GROUP):
            a = abs(values[g, i])
            # A NaN wins and stays, as in torch's amax.
            if a > m or a != a:
                m = a
        out[g] = m


@numba.njit(cache=True, nogil=True, inline="always")
def _pack_group(y: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    """Pack the E2M1 codes of 16 quotients `y` (fp32) into the 8 bytes `out`.

    No clamp to ±6: a magnitude above 6 passes every bound exactly as 6 does, and a NaN
    passes none (code 0), as after torch's clamp. Plain fixed-length loops over the group
    so that the compiler vectorises them.
    """
    for i in range(_GROUP):
        a = abs(y[i])
        # The bounds of `nvfp4._BOUNDS`: ties at 0.25/1.25/2.5/5 stay down (>), ties at
        # 0.75/1.75/3.5 go up (>=): round-to-nearest-even on the E2M1 grid.
        code = (
            np.uint8(a > _B025) + np.uint8(a >= _B075) + np.uint8(a > _B125)
            + np.uint8(a >= _B175) + np.uint8(a > _B250) + np.uint8(a >= _B350)
            + np.uint8(a > _B500)
        )  # fmt: skip
        codes[i] = code | (np.uint8(y[i] < -_B025) << 3)
    for i in range(_GROUP // 2):
        out[i] = codes[2 * i] | (codes[2 * i + 1] << 4)


def _encode_py(values: np.ndarray, divisor: np.ndarray, out: np.ndarray) -> None:
    y = np.empty(_GROUP, np.float32)
    codes = np.empty(_GROUP, np.uint8)
    for g in range(values.shape[0]):
        d = divisor[g]
        for i in range(_GROUP):
            y[i] = values[g, i] / d
        _pack_group(y, codes, out[g])


_group_amax = _jit(_group_amax_py)
_encode = _jit(_encode_py)


# E2M1 bounds in code order, and whether a tie at the bound rounds up (>=) or down (>).
_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_TIES_UP = np.array([False, True, False, True, False, True, False])
_INF_BITS = 0x7F80  # BF16 +inf; magnitude bits above it are NaNs
_READY = 7  # column of a `code_bounds` row that says the row is filled
# Column of `code_bounds` holding, in row c, the least group-amax magnitude bits whose scale
# byte is c or more (row 256: past every amax); `[256, _READY]` says the column is filled.
_SCALE_FROM = 8
_NO_AMAX = _INF_BITS + 1  # "no such amax": above inf, below every NaN's bits


def new_code_bounds() -> np.ndarray:
    """An empty table for `recode_groups_in_place` (uint16 [257, 9]); one per global scale:
    row c < 256 holds, for the group scale of E4M3 byte c, the least BF16 magnitude bits
    past each E2M1 bound, and column 7 says whether the row was filled; column 8 holds the
    least group-amax magnitude bits whose scale byte is c or more."""
    return np.zeros((257, 9), np.uint16)


@_jit
def _fill_code_bounds(scale_2: np.float32, code: np.uint8, table: np.ndarray) -> None:
    # x/d is correctly rounded and d > 0, so fl(x/d) never decreases as x grows: the BF16
    # magnitudes whose quotient passes a bound are exactly those from some least one on,
    # found by bisection with the very division a full conversion runs (inf always passes).
    divisor = e4m3_value(code) * scale_2
    for k in range(_BOUNDS.size):
        lo, hi = 0, _INF_BITS
        while lo < hi:
            mid = (lo + hi) // 2
            y = bf16_value(np.uint16(mid)) / divisor
            passes = y >= _BOUNDS[k] if _TIES_UP[k] else y > _BOUNDS[k]
            if passes:
                hi = mid
            else:
                lo = mid + 1
        table[code, k] = lo
    table[code, _READY] = 1


def _prefetch_intrinsic(typingctx: Any, array: Any, index: Any) -> Any:
    """Ask for the cache line of `array[index]` (LLVM's prefetch: read, all cache levels)."""
    sig = types.void(array, index)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        insert: Any = cgutils.get_or_insert_function
        fn = insert(builder.module, fnty, "llvm.prefetch.p0i8")
        flags = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        builder.call(fn, [builder.bitcast(ptr, i8p), *flags])
        return context.get_dummy_value()

    return sig, codegen


_prefetch: Any = intrinsic(_prefetch_intrinsic)


@_jit
def _scale_code(amax: np.float32, denominator: np.float32) -> np.uint8:
    # `nvfp4.group_scales`: amax/(6·scale_2), 1.0 for a zero group, clamped, cast.
    ideal = amax / denominator if amax > 0 else np.float32(1.0)
    return e4m3_code(min(max(ideal, _MIN_SCALE), _MAX_SCALE))


@_jit
def _fill_scale_from(denominator: np.float32, table: np.ndarray) -> None:
    # The scale byte never decreases as a positive amax grows (a correctly rounded division
    # by a positive number, a clamp and a nearest-even cast are each monotonic), so the
    # amaxes of each byte are one run of magnitude bits in [1, inf]: bisect for where each
    # run starts, with the very division and cast the group's coding runs.
    for code in range(256):
        lo, hi = 1, _NO_AMAX
        while lo < hi:
            mid = (lo + hi) // 2
            if _scale_code(bf16_value(np.uint16(mid)), denominator) >= code:
                hi = mid
            else:
                lo = mid + 1
        table[code, _SCALE_FROM] = lo
    table[256, _SCALE_FROM] = _NO_AMAX
    table[256, _READY] = 1


@numba.njit(cache=True, nogil=True, inline="always")
def _nibble(w: np.int32, b0: np.int32, b1: np.int32, b2: np.int32, b3: np.int32,
            b4: np.int32, b5: np.int32, b6: np.int32) -> np.int32:  # fmt: skip
    # The E2M1 code is how many bounds the magnitude reaches: no division per element,
    # and int32 lanes the compiler vectorises. A NaN codes as 0 (every comparison of
    # torch's coder is false); the sign bit goes with a non-zero code only, as `y < -0.25`.
    m = w & 0x7FFF
    c = (
        np.int32(m >= b0) + np.int32(m >= b1) + np.int32(m >= b2) + np.int32(m >= b3)
        + np.int32(m >= b4) + np.int32(m >= b5) + np.int32(m >= b6)
    ) * np.int32(m <= _INF_BITS)  # fmt: skip
    return c | (((w >> 15) & np.int32(c != 0)) << 3)


@_jit
def _recode_one(
    weight: np.ndarray,
    positions: np.ndarray,
    scale_2: np.float32,
    packed: np.ndarray,
    scale_bytes: np.ndarray,
    code_bounds: np.ndarray,
    holder_bits: int,
) -> tuple[int, np.float32, bool, np.ndarray, np.uint8]:
    denominator = np.float32(6.0) * scale_2
    if code_bounds[256, _READY] == 0:
        _fill_scale_from(denominator, code_bounds)
    largest = np.float32(0.0)
    old_max_scale = False
    holders = np.empty(_GROUP, np.int64)  # grows below; almost always stays empty
    held = 0
    count = 0
    last = np.int64(-1)
    groups = np.empty(_CHUNK, np.int64)
    starts = np.empty(_CHUNK + 1, np.int64)  # each group's first index in `positions`
    old_scales = np.empty(_CHUNK, np.uint8)
    nibbles = np.empty(_GROUP, np.int32)
    gathered_words = np.empty((_CHUNK, _GROUP // 4), np.uint64)
    gathered = gathered_words.view(np.uint16)
    words = weight.view(np.uint64)
    touched = np.uint8(0)
    i = 0
    while i < positions.size:
        # Gather a chunk of distinct groups first: independent loads overlap their cache
        # misses (weights, old scales, and the packed bytes about to be written), which
        # the coding loop would otherwise wait for one by one.
        n = 0
        while i < positions.size:
            p = positions[i]
            if p < 0 or p >= weight.size:
                raise IndexError("a changed position lies outside the tensor")
            g = p >> 4
            if i + _AHEAD < positions.size:
                ahead = positions[i + _AHEAD] >> 4
                if 0 <= ahead < scale_bytes.size:  # an outside position raises when met
                    _prefetch(weight, ahead * _GROUP)
                    _prefetch(packed, ahead * (_GROUP // 2))
                    _prefetch(scale_bytes, ahead)
            if g != last:
                if n == _CHUNK:
                    break  # the chunk is full; this group starts the next one
                last = g
                groups[n] = g
                starts[n] = i
                for j in range(_GROUP // 4):  # the group's 32 bytes as four 8-byte words
                    gathered_words[n, j] = words[g * (_GROUP // 4) + j]
                old_scales[n] = scale_bytes[g]
                touched ^= packed[g * (_GROUP // 2)]  # the line written below, loaded now
                n += 1
            i += 1  # positions are sorted: a group's positions follow one another
        starts[n] = i
        count += n
        for k in range(n):
            g = groups[k]
            first = g * _GROUP
            # max |x| as the largest magnitude bit pattern: BF16 magnitudes order as their
            # bits do, and a NaN's bits exceed every number's (NaN wins, as in torch).
            top = 0
            for j in range(_GROUP):
                top = max(top, gathered[k, j] & 0x7FFF)
            if top == holder_bits:
                # Elements of a changed group that equal the global amax hold it now.
                for j in range(_GROUP):
                    if (gathered[k, j] & 0x7FFF) == holder_bits:
                        if held == holders.size:
                            grown = np.empty(2 * held, np.int64)
                            grown[:held] = holders
                            holders = grown
                        holders[held] = first + j
                        held += 1
            amax = bf16_value(np.uint16(top))
            if amax > largest or amax != amax:
                largest = amax
            old = old_scales[k]
            # An old scale of 448 marks a group that may have held the global amax.
            old_max_scale |= (old & 0x7F) == 0x7E
            # The group's scale byte stays when its amax is still in the old byte's run
            # (a zero or NaN amax never is): the unchanged elements keep their codes, so
            # only the changed ones are coded, each into its nibble of the packed byte.
            if code_bounds[old, _SCALE_FROM] <= top < code_bounds[old + 1, _SCALE_FROM]:
                code = old
                scale_kept = True
            else:
                code = _scale_code(amax, denominator)
                scale_bytes[g] = code
                scale_kept = False
            if code_bounds[code, _READY] == 0:
                _fill_code_bounds(scale_2, code, code_bounds)
            b0, b1, b2, b3 = (
                np.int32(code_bounds[code, 0]),
                np.int32(code_bounds[code, 1]),
                np.int32(code_bounds[code, 2]),
                np.int32(code_bounds[code, 3]),
            )
            b4, b5, b6 = (
                np.int32(code_bounds[code, 4]),
                np.int32(code_bounds[code, 5]),
                np.int32(code_bounds[code, 6]),
            )
            if scale_kept:
                for at in range(starts[k], starts[k + 1]):
                    p = positions[at]
                    c = _nibble(np.int32(gathered[k, p & (_GROUP - 1)]), b0, b1, b2, b3, b4, b5, b6)
                    byte = p >> 1
                    if p & 1:
                        packed[byte] = np.uint8((packed[byte] & 0x0F) | (c << 4))
                    else:
                        packed[byte] = np.uint8((packed[byte] & 0xF0) | c)
                continue
            for j in range(_GROUP):
                nibbles[j] = _nibble(np.int32(gathered[k, j]), b0, b1, b2, b3, b4, b5, b6)
            base = g * (_GROUP // 2)
            for j in range(_GROUP // 2):
                packed[base + j] = np.uint8(nibbles[2 * j] | (nibbles[2 * j + 1] << 4))
    # `touched` is returned so that the compiler keeps the loads that fetched those lines.
    return count, largest, old_max_scale, holders[:held], touched


@dataclass(frozen=True)
class GroupUpdate:
    """What `recode_groups_in_place` saw in the 16-element groups holding a change."""

    groups: int  # how many groups were recoded
    amax: float  # max |x| over the changed groups
    old_scale_was_448: bool  # a changed group's previous scale was 448
    # int64, sorted: elements of the changed groups whose |x| has the bits `holder_bits`
    new_holders: np.ndarray


def recode_groups_in_place(
    weight: np.ndarray,
    positions: np.ndarray,
    scale_2: float,
    packed: np.ndarray,
    scale_bytes: np.ndarray,
    code_bounds: np.ndarray,
    holder_bits: int,
) -> GroupUpdate:
    """Recode, in place, every 16-element group of BF16 `weight` (uint16 bits, flat) that
    holds one of the sorted flat `positions`: its E4M3 scale byte in `scale_bytes` and its
    packed E2M1 codes in `packed` (both flat), bit for bit as `nvfp4.encode_groups` codes
    them under `scale_2`. `code_bounds` (`new_code_bounds`) caches per scale code the
    magnitudes where the E2M1 code steps, filled as codes are met; it belongs to `scale_2`
    and must be renewed when it changes. A caller whose global amax turns out to have moved
    recodes the whole tensor group afterwards, overwriting these bytes."""
    count, amax, old_448, holders, _ = _recode_one(
        weight, positions, np.float32(scale_2), packed, scale_bytes, code_bounds, holder_bits
    )
    return GroupUpdate(int(count), float(amax), bool(old_448), holders)


def _pointer_intrinsic(element: Any) -> Any:
    """An intrinsic that reads an int64 address as a pointer to `element`s."""

    def typer(typingctx: Any, address: Any) -> Any:
        pointer: Any = types.CPointer
        sig = pointer(element)(address)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return intrinsic(typer)


_u16_at: Any = _pointer_intrinsic(types.uint16)
_u8_at: Any = _pointer_intrinsic(types.uint8)
_i64_at: Any = _pointer_intrinsic(types.int64)

# Columns of a `recode_tensors_in_place` table row: one row per changed tensor.
WEIGHT, ELEMENTS, POSITIONS, CHANGED, PACKED, SCALES, GLOBAL = range(7)
COLUMNS = 7


@_jit
def _recode_tensors(
    table: np.ndarray, bounds: np.ndarray, scale_2: np.ndarray, holder_bits: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.uint8]:
    rows = table.shape[0]
    counts = np.zeros(rows, np.int64)
    amaxes = np.zeros(rows, np.float32)
    old_448 = np.zeros(rows, np.bool_)
    holder_ends = np.zeros(rows, np.int64)
    holders = np.empty(_GROUP, np.int64)
    held = 0
    touched = np.uint8(0)
    for t in range(rows):
        elements = table[t, ELEMENTS]
        f = table[t, GLOBAL]
        count, amax, lost, found, seen = _recode_one(
            numba.carray(_u16_at(table[t, WEIGHT]), elements),
            numba.carray(_i64_at(table[t, POSITIONS]), table[t, CHANGED]),
            scale_2[f],
            numba.carray(_u8_at(table[t, PACKED]), elements // 2),
            numba.carray(_u8_at(table[t, SCALES]), elements // _GROUP),
            bounds[f],
            holder_bits[f],
        )
        counts[t], amaxes[t], old_448[t] = count, amax, lost
        if held + found.size > holders.size:
            grown = np.empty(2 * (held + found.size), np.int64)
            grown[:held] = holders[:held]
            holders = grown
        holders[held : held + found.size] = found
        held += found.size
        holder_ends[t] = held
        touched ^= seen
    return counts, amaxes, old_448, holders[:held], holder_ends, touched


@dataclass(frozen=True)
class TensorUpdates:
    """What `recode_tensors_in_place` saw, one entry per table row (as `GroupUpdate`)."""

    groups: np.ndarray  # int64: groups recoded
    amax: np.ndarray  # float32: max |x| over the changed groups
    old_scale_was_448: np.ndarray  # bool
    holders: np.ndarray  # int64: every row's new holders, row after row
    holder_ends: np.ndarray  # int64: where each row's new holders end in `holders`

    def new_holders(self, row: int) -> np.ndarray:
        start = int(self.holder_ends[row - 1]) if row else 0
        return self.holders[start : int(self.holder_ends[row])]


def recode_tensors_in_place(
    table: np.ndarray, bounds: np.ndarray, scale_2: np.ndarray, holder_bits: np.ndarray
) -> TensorUpdates:
    """`recode_groups_in_place` over many tensors in one compiled call, so that a version's
    step is one call rather than one per tensor (the Python around ~100 calls cost as much
    as a sixth of a sparse step). `table` (int64 `[T, COLUMNS]`) holds per changed tensor
    the addresses and sizes of its arrays: BF16 weight bits (`WEIGHT`, `ELEMENTS` long),
    sorted int64 positions (`POSITIONS`, `CHANGED` long), packed codes (`PACKED`) and scale
    bytes (`SCALES`), and `GLOBAL`, the row of its fused group in `bounds` (uint16
    `[F, 257, 9]`, each a `new_code_bounds` table), `scale_2` (float32 `[F]`) and
    `holder_bits` (int64 `[F]`). Every address must be of a live, C-contiguous array of
    that size and type, held by the caller for the call: nothing here can check them."""
    counts, amaxes, old_448, holders, ends, _ = _recode_tensors(table, bounds, scale_2, holder_bits)
    return TensorUpdates(counts, amaxes, old_448, holders, ends)


def group_amax(values: np.ndarray) -> np.ndarray:
    """max |x| (fp32 `[G]`) of each row of fp32 groups `[G, 16]`; NaN if a row holds one."""
    out = np.empty(values.shape[0], np.float32)
    _group_amax(np.ascontiguousarray(values), out)
    return out


def encode_packed(values: np.ndarray, divisor: np.ndarray) -> np.ndarray:
    """Packed E2M1 codes `[G, 8]` of fp32 groups `[G, 16]` divided by `divisor[g]`,
    saturated at ±6; element 2i in the low nibble."""
    out = np.empty((values.shape[0], _GROUP // 2), np.uint8)
    _encode(np.ascontiguousarray(values), np.ascontiguousarray(divisor, np.float32), out)
    return out


@numba.njit(cache=True, nogil=True, inline="always")
def _pair_max(pairs: np.ndarray, count: int, out: np.ndarray, mask: np.uint32) -> None:
    """`out[i]` = the larger uint16 half of `pairs[i] & mask`, for `i < count`."""
    for i in range(count):
        x = pairs[i] & mask
        out[i] = np.uint16(max(x & np.uint32(0xFFFF), x >> np.uint32(16)))


@_jit
def _group_tops(words: np.ndarray, first: int, count: int, scratch: np.ndarray) -> None:
    """Largest magnitude bits of `count` groups from group `first` into `scratch[14·T:]`
    (T = `_TOPS_PER_STEP`; `words` is the BF16 weight as uint32, two elements a word):
    max |x| per group, as bits (magnitudes order as their bits do; a NaN's exceed every
    number's). Pairwise maxima level by level, 16 → 8 → 4 → 2 → 1, the levels at 0, 8·T,
    12·T and 14·T: each a contiguous loop the compiler vectorises, where a maximum within
    each group is a horizontal reduction that it does not. Each level reads the one below
    as uint32 pairs, not as two stride-2 uint16 streams: that deinterleave vectorises only
    where AVX-512 makes it cheap, and on an AVX2 host the loops ran scalar."""
    pairs = scratch.view(np.uint32)
    four, two, one = 8 * _TOPS_PER_STEP, 12 * _TOPS_PER_STEP, 14 * _TOPS_PER_STEP
    start = first * (_GROUP // 2)
    _pair_max(words[start : start + count * 8], count * 8, scratch, np.uint32(0x7FFF7FFF))
    _pair_max(pairs, count * 4, scratch[four:], np.uint32(0xFFFFFFFF))
    _pair_max(pairs[four // 2 :], count * 2, scratch[two:], np.uint32(0xFFFFFFFF))
    _pair_max(pairs[two // 2 :], count, scratch[one:], np.uint32(0xFFFFFFFF))


@numba.njit(cache=True, nogil=True, inline="always")
def _nibble16(w: np.int16, b0: np.int16, b1: np.int16, b2: np.int16, b3: np.int16,
              b4: np.int16, b5: np.int16, b6: np.int16) -> np.int16:  # fmt: skip
    # `_nibble` in int16 throughout: numba widens integer sums to int64 and the vectoriser
    # follows the widest type, so a plain sum of comparisons ran in 64-bit lanes (four to
    # an AVX2 register, with the widening shuffles); narrowed after each add, one group's
    # 16 elements are one AVX2 register. A NaN codes 0, the sign goes with c != 0 only.
    m = np.int16(w & np.int16(0x7FFF))
    c = np.int16(np.int16(m >= b0) + np.int16(m >= b1))
    c = np.int16(c + np.int16(np.int16(m >= b2) + np.int16(m >= b3)))
    c = np.int16(c + np.int16(np.int16(m >= b4) + np.int16(m >= b5)))
    c = np.int16(c + np.int16(m >= b6))
    c = c if m <= np.int16(_INF_BITS) else np.int16(0)
    return np.int16(c | (np.int16(8) if w < 0 and c != 0 else np.int16(0)))


@_jit
def _quantize_full(
    weight: np.ndarray,
    scale_2: np.float32,
    packed: np.ndarray,
    scale_bytes: np.ndarray,
    code_bounds: np.ndarray,
) -> None:
    denominator = np.float32(6.0) * scale_2
    scratch = np.empty(15 * _TOPS_PER_STEP, np.uint16)
    tops = scratch[14 * _TOPS_PER_STEP :]
    codes = np.empty(_TOPS_PER_STEP * _GROUP, np.int16)
    code_pairs = codes.view(np.uint32)  # element 2i low, 2i + 1 high: a packed byte each
    words = weight.view(np.uint32)
    # The scale byte is a function of the group's largest magnitude bits alone: computed
    # (a division and the E4M3 cast) once per distinct pattern met, then looked up. 0xFF,
    # a negative NaN, is never a scale byte, so it marks a pattern not met yet.
    scale_of_top = np.full(0x8000, np.uint8(0xFF))
    # The E2M1 bounds of each scale byte met, as int16 (`code_bounds` rows, copied when
    # the byte is first met): one row to load per group.
    bounds = np.empty((256, 8), np.int16)
    groups = weight.size // _GROUP
    # Per step of T groups: their amaxes, then their scale bytes, then their codes, then
    # the codes packed; plain indexing within a step (a slice per group would cost a
    # reference count update each).
    for first in range(0, groups, _TOPS_PER_STEP):
        count = min(_TOPS_PER_STEP, groups - first)
        _group_tops(words, first, count, scratch)
        scales = scale_bytes[first : first + count]
        for k in range(count):
            top = tops[k]
            code = scale_of_top[top]
            if code == 0xFF:
                code = _scale_code(bf16_value(top), denominator)
                scale_of_top[top] = code
                if code_bounds[code, _READY] == 0:
                    _fill_code_bounds(scale_2, code, code_bounds)
                for b in range(_BOUNDS.size):
                    bounds[code, b] = np.int16(code_bounds[code, b])
            scales[k] = code
        block = weight[first * _GROUP : (first + count) * _GROUP]
        for k in range(count):
            # As `_recode_one` codes: how many bounds the magnitude reaches.
            row = bounds[scales[k]]
            b0, b1, b2, b3, b4, b5, b6 = row[0], row[1], row[2], row[3], row[4], row[5], row[6]
            for j in range(_GROUP):
                at = k * _GROUP + j
                codes[at] = _nibble16(np.int16(block[at]), b0, b1, b2, b3, b4, b5, b6)
        out = packed[first * (_GROUP // 2) : (first + count) * (_GROUP // 2)]
        for i in range(count * (_GROUP // 2)):
            pair = code_pairs[i]
            out[i] = np.uint8((pair | (pair >> np.uint32(12))) & np.uint32(0xFF))


def quantize_full(
    weight: np.ndarray, scale_2: float, code_bounds: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Full NVFP4 conversion of BF16 `weight` (uint16 bits, flat, a multiple of 16 long)
    under a finite `scale_2`, in one compiled pass with no division per element: (packed
    codes uint8 `[n/2]`, E4M3 scale bytes `[n/16]`), the bytes of `nvfp4.encode_groups`.
    `code_bounds` (`new_code_bounds`, belonging to `scale_2`) may be shared by the tensors
    of a fused group; the bisection that fills it assumes `scale_2` is finite."""
    if code_bounds is None:
        code_bounds = new_code_bounds()
    packed = np.empty(weight.size // 2, np.uint8)
    scale_bytes = np.empty(weight.size // _GROUP, np.uint8)
    _quantize_full(weight, np.float32(scale_2), packed, scale_bytes, code_bounds)
    return packed, scale_bytes


@_jit
def _top_bits(weight: np.ndarray) -> int:
    top = np.uint16(0)
    for i in range(weight.size):
        top = max(top, weight[i] & np.uint16(0x7FFF))
    return int(top)


def tensor_amax_bits(weight: np.ndarray) -> float:
    """max |x| of BF16 `weight` (uint16 bits, flat): NaN if it holds a NaN, 0.0 if empty;
    one vectorised pass over the bits, where torch's max and min read it twice."""
    top = int(_top_bits(weight))
    return float("nan") if top > _INF_BITS else float(bf16_value(np.uint16(top)))
