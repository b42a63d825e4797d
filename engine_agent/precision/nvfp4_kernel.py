"""The compiled inner loop of NVFP4 encoding: per-group amax, and E2M1 coding plus packing.

Owns two numba kernels over fp32 16-element groups `[G, 16]`. A chain of torch
elementwise ops (abs, seven comparisons and adds, sign, pack) reads and writes the chunk
about twenty times, which held a full conversion near 0.3 GB/s per core; one fused pass
per group keeps the 16 values in registers and runs at several times that.

The kernels reproduce `nvfp4.e2m1_codes` and `nvfp4.pack_nibbles` bit for bit: the
division is the same correctly rounded fp32 IEEE division torch runs (no fastmath), the
clamp keeps NaN as torch's does, and the code is the same count of the same bounds with
the same tie rules. `tests/engine_agent/test_precision.py` checks them against the torch
reference on every BF16 bit pattern. Must never compute scales: those stay torch ops in
`nvfp4` (their E4M3 rounding is torch's).
"""

from __future__ import annotations

import numba
import numpy as np

_GROUP = 16
_MAX = np.float32(6.0)
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


def _encode_py(values: np.ndarray, divisor: np.ndarray, out: np.ndarray) -> None:
    codes = np.empty(_GROUP, np.uint8)
    for g in range(values.shape[0]):
        d = divisor[g]
        for i in range(_GROUP):
            y = values[g, i] / d
            if y == y:  # torch's clamp keeps NaN (whose code is then 0)
                y = min(max(y, -_MAX), _MAX)
            a = abs(y)
            # The bounds of `nvfp4._BOUNDS`: ties at 0.25/1.25/2.5/5 stay down (>), ties at
            # 0.75/1.75/3.5 go up (>=): round-to-nearest-even on the E2M1 grid.
            code = (
                np.uint8(a > 0.25) + np.uint8(a >= 0.75) + np.uint8(a > 1.25)
                + np.uint8(a >= 1.75) + np.uint8(a > 2.5) + np.uint8(a >= 3.5)
                + np.uint8(a > 5.0)
            )  # fmt: skip
            codes[i] = code | (np.uint8(y < -0.25) << 3)
        for i in range(_GROUP // 2):
            out[g, i] = codes[2 * i] | (codes[2 * i + 1] << 4)


_group_amax = _jit(_group_amax_py)
_encode = _jit(_encode_py)


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
