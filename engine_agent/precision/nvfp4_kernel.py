"""The compiled inner loops of NVFP4 encoding: per-group amax, E2M1 coding plus packing,
and the incremental recoding of the groups a change touched.

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
`tests/engine_agent/test_precision.py` checks them against the torch reference on every
BF16 bit pattern. Must never choose a global scale (that is the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from engine_agent.precision.fp8_kernel import bf16_value, e4m3_code, e4m3_value

_GROUP = 16
# The E2M1 rounding bounds as fp32 (each exact), compared without widening to fp64.
_B025, _B075, _B125, _B175 = np.float32(0.25), np.float32(0.75), np.float32(1.25), np.float32(1.75)
_B250, _B350, _B500 = np.float32(2.5), np.float32(3.5), np.float32(5.0)
_MIN_SCALE = np.float32(2.0**-9)  # `nvfp4.E4M3_MIN_SUBNORMAL`
_MAX_SCALE = np.float32(448.0)
_CHUNK = 1024  # groups gathered per step (their scratch stays in L1)
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


@_jit
def _recode_groups(
    weight: np.ndarray,
    positions: np.ndarray,
    scale_2: np.float32,
    old_scales: np.ndarray,
    holder_bits: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.float32, bool, np.ndarray]:
    # The distinct 16-element groups holding a change (positions are sorted).
    groups = np.empty(positions.size, np.int64)
    count = 0
    for i in range(positions.size):
        if positions[i] < 0 or positions[i] >= weight.size:
            raise IndexError("a changed position lies outside the tensor")
        g = positions[i] >> 4
        if count == 0 or groups[count - 1] != g:
            groups[count] = g
            count += 1
    groups = groups[:count]
    codes = np.empty((count, _GROUP // 2), np.uint8)
    scales = np.empty(count, np.uint8)
    denominator = np.float32(6.0) * scale_2
    largest = np.float32(0.0)
    old_max_scale = False
    gathered = np.empty((_CHUNK, _GROUP), np.uint16)
    holders = np.empty(_GROUP, np.int64)  # grows below; almost always stays empty
    held = 0
    y = np.empty(_GROUP, np.float32)
    pack_scratch = np.empty(_GROUP, np.uint8)
    for start in range(0, count, _CHUNK):
        stop = min(start + _CHUNK, count)
        # Gather first: independent loads overlap their cache misses, which the coding
        # loop (a dependent chain per group) would otherwise wait for one by one.
        for j in range(start, stop):
            base = groups[j] * _GROUP
            for i in range(_GROUP):
                gathered[j - start, i] = weight[base + i]
            # An old scale of 448 marks a group that may have held the global amax.
            old_max_scale |= (old_scales[groups[j]] & 0x7F) == 0x7E
        for j in range(start, stop):
            values = gathered[j - start]
            # max |x| as the largest magnitude bit pattern: BF16 magnitudes order as their
            # bits do, and a NaN's bits exceed every number's (NaN wins, as in torch).
            top = 0
            for i in range(_GROUP):
                top = max(top, values[i] & 0x7FFF)
            amax = bf16_value(np.uint16(top))
            if top == holder_bits:
                # Elements of a changed group that equal the global amax hold it now.
                for i in range(_GROUP):
                    if (values[i] & 0x7FFF) == holder_bits:
                        if held == holders.size:
                            grown = np.empty(2 * held, np.int64)
                            grown[:held] = holders
                            holders = grown
                        holders[held] = groups[j] * _GROUP + i
                        held += 1
            if amax > largest or amax != amax:
                largest = amax
            # `nvfp4.group_scales`: amax/(6·scale_2), 1.0 for a zero group, clamped, cast.
            ideal = amax / denominator if amax > 0 else np.float32(1.0)
            code = e4m3_code(min(max(ideal, _MIN_SCALE), _MAX_SCALE))
            scales[j] = code
            divisor = e4m3_value(code) * scale_2
            for i in range(_GROUP):
                y[i] = bf16_value(values[i]) / divisor
            _pack_group(y, pack_scratch, codes[j])
    return groups, codes, scales, largest, old_max_scale, holders[:held]


@_jit
def _write_groups(
    packed: np.ndarray, scale_bytes: np.ndarray, update_groups: np.ndarray, codes: np.ndarray,
    scales: np.ndarray,
) -> None:  # fmt: skip
    for j in range(update_groups.size):
        g = update_groups[j]
        scale_bytes[g] = scales[j]
        for i in range(_GROUP // 2):
            packed[g * (_GROUP // 2) + i] = codes[j, i]


@dataclass(frozen=True)
class GroupUpdate:
    """New codes and scales of the 16-element groups holding a change, not yet written."""

    groups: np.ndarray  # int64 [G]: group index (flat element index >> 4)
    codes: np.ndarray  # uint8 [G, 8]: packed E2M1 codes
    scales: np.ndarray  # uint8 [G]: float8_e4m3fn bytes of the group scales
    amax: float  # max |x| over the changed groups
    old_scale_was_448: bool  # a changed group's previous scale was 448
    # int64, sorted: elements of the changed groups whose |x| has the bits `holder_bits`
    new_holders: np.ndarray

    def write(self, packed: np.ndarray, scale_bytes: np.ndarray) -> None:
        """Store the codes and scales into a tensor's flat packed bytes and scale bytes."""
        _write_groups(packed, scale_bytes, self.groups, self.codes, self.scales)


def recode_groups(
    weight: np.ndarray,
    positions: np.ndarray,
    scale_2: float,
    old_scales: np.ndarray,
    holder_bits: int,
) -> GroupUpdate:
    """Codes and scales of every 16-element group of BF16 `weight` (uint16 bits, flat) that
    holds one of the sorted flat `positions`, with the exact operations of
    `nvfp4.encode_groups`; `old_scales` are the tensor's current scale bytes (flat)."""
    groups, codes, scales, amax, old_448, holders = _recode_groups(
        weight, positions, np.float32(scale_2), old_scales, holder_bits
    )
    return GroupUpdate(groups, codes, scales, float(amax), bool(old_448), holders)


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
