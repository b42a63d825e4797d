"""The compiled inner loops of `sparse-v2`: finding changes, Rice packing, applying steps.

Owns four numba kernels over one block of elements (unsigned ints of the element width).
As chains of numpy passes (compare, flatnonzero, diff, gather, per-plane packbits, cumsum,
scatter) each changed element was read and written ten to twenty times, which held encode
near 0.6 and apply near 1.4 GB/s per core at 10 % density; one pass per stream keeps each
element in registers. The kernels release the GIL (`nogil`), so the codec's thread pools
run blocks and tensors on every core.

They write exactly the bytes `bitstreams.pack_fields` and `bitstreams.unary_stream` write
(docs/format.md §5: low bits as planes, least significant plane first, each packed most
significant bit first; unary codes as q zeros then a one); `tests/store/test_codec_sparse_v2.py`
checks them against those numpy references. Kernels never raise: decoders return an error
code that `sparse_v2` turns into `CorruptPayload`. Must never allocate per element or
interpret payload headers.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros as _leading_zeros
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros

# cache=True: compiled once per machine (about a second per element width), not per process.
_jit = numba.njit(cache=True, nogil=True)

# Bit-scan intrinsics (one instruction each); typed Any as their Python signature is the
# compiler's, not the call's.
trailing_zeros: Any = _trailing_zeros
leading_zeros: Any = _leading_zeros

OK = 0
ERR_UNARY = 1  # the unary stream holds another number of codes than declared
ERR_POSITION = 2  # a change lands past the end of the block
ERR_MAGNITUDE = 3  # a magnitude is placed past the last change


def _gather_changes_py(
    new: np.ndarray,
    old: np.ndarray,
    changed: np.ndarray,
    gaps: np.ndarray,
    news: np.ndarray,
    olds: np.ndarray,
) -> None:
    """Fill `gaps` (unchanged elements before each change), `news` and `olds` in one pass.

    `changed` is the block's change mask as little-endian bits, 64 elements per word
    (`change_mask` builds it); visiting its set bits avoids a branch per element, which
    mispredicts at every change.
    """
    j = 0
    last = -1
    for w in range(changed.size):
        m = changed[w]
        start = w * 64
        while m:
            i = start + trailing_zeros(m)
            m &= m - np.uint64(1)
            gaps[j] = i - last - 1
            news[j] = new[i]
            olds[j] = old[i]
            last = i
            j += 1


_SCAN_CHUNK = 4096  # elements compared per step: their flags stay in L1 while gathered
_PACK_FLAGS = np.uint64(0x0102040810204080)  # byte t (0 or 1) of a word -> bit 56 + t


def _change_mask_py(new: np.ndarray, old: np.ndarray, words: np.ndarray) -> int:
    """Fill `words` with the block's change mask for `gather_changes` (bit t of word w set
    iff element 64w + t changed); return how many changed.

    Per chunk of 4096 elements: compare into byte flags and count them (a loop over
    slices, which the compiler turns into SIMD), then pack each 8 flags into a byte with
    one multiply (no two partial products meet, so nothing carries). numpy's
    not_equal + count_nonzero + packbits + a zero-padded copy were four passes and three
    fresh block-sized allocations.
    """
    flags = np.zeros(_SCAN_CHUNK, np.uint8)
    as_words = flags.view(np.uint64)
    total = 0
    for start in range(0, new.size, _SCAN_CHUNK):
        a = new[start : start + _SCAN_CHUNK]
        b = old[start : start + _SCAN_CHUNK]
        m = a.size
        count = 0
        for i in range(m):
            f = a[i] != b[i]
            flags[i] = f
            count += f
        total += count
        padded = -(-m // 64) * 64
        for i in range(m, padded):
            flags[i] = 0
        first = start // 64
        for w in range(padded // 64):
            bits = np.uint64(0)
            if count:
                for t in range(8):
                    packed = (as_words[8 * w + t] * _PACK_FLAGS) >> np.uint64(56)
                    bits |= packed << np.uint64(8 * t)
            words[first + w] = bits
    return total


def _rice_pack_py(values: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray, np.int64]:
    """(low planes, unary stream, unary bit count) of `values` Rice-coded with parameter r:
    r planes of ceil(k/8) bytes, then each quotient as q zero bits and a one."""
    k = values.size
    bits = np.int64(k)
    for i in range(k):
        bits += np.int64(np.uint64(values[i]) >> np.uint64(r))
    unary = np.zeros((bits + 7) // 8, np.uint8)
    bit = np.int64(0)
    for i in range(k):
        bit += np.int64(np.uint64(values[i]) >> np.uint64(r))
        unary[bit >> 3] |= np.uint8(0x80 >> (bit & 7))
        bit += 1
    plane = (k + 7) // 8
    low = np.empty(r * plane, np.uint8)
    # Per group of 8 values: their low bytes side by side in one word (value t in byte t),
    # then each plane's byte is one mask and one multiply: bit 8t moves to bit 63 - t, and
    # no two partial products meet, so nothing carries (Hacker's Delight's bit gather).
    spread = np.uint64(0x0101010101010101)
    gather = np.uint64(0x8040201008040201)
    whole = k // 8  # groups of exactly 8 values: a loop of fixed length, unrolled
    for group in range(plane):
        start = group * 8
        stop = min(start + 8, k)
        for word in range((r + 7) // 8):
            w = np.uint64(0)
            if group < whole:
                for t in range(8):
                    byte = (np.uint64(values[start + t]) >> np.uint64(8 * word)) & np.uint64(0xFF)
                    w |= byte << np.uint64(8 * t)
            else:
                for t in range(start, stop):
                    byte = (np.uint64(values[t]) >> np.uint64(8 * word)) & np.uint64(0xFF)
                    w |= byte << np.uint64(8 * (t - start))
            for j in range(8 * word, min(8 * word + 8, r)):
                bits_j = (w >> np.uint64(j - 8 * word)) & spread
                low[j * plane + group] = np.uint8((bits_j * gather) >> np.uint64(56))
    return low, unary, bits


def _plane_lanes_py(low: np.ndarray, plane: int, group: int, first: int, last: int) -> np.uint64:
    """Bits `first`..`last - 1` (at most 8) of the 8 values of `group`, one value per byte
    lane (value t in byte t), from the low planes of `rice_pack`.

    Each plane byte is spread to one 0/1 byte per value (mask byte t with 0x80 >> t, then
    carry its bit to the lane's top and down to bit 0), and the planes stacked in the lanes.
    """
    replicate = np.uint64(0x0101010101010101)
    select = np.uint64(0x0102040810204080)
    low_bits = np.uint64(0x7F7F7F7F7F7F7F7F)
    lanes = np.uint64(0)
    for jj in range(first, last):
        spread = (np.uint64(low[jj * plane + group]) * replicate) & select
        spread = ((spread + low_bits) >> np.uint64(7)) & replicate
        lanes |= spread << np.uint64(jj - first)
    return lanes


def _rice_unpack_py(
    low: np.ndarray, unary: np.ndarray, unary_bits: int, r: int, out: np.ndarray
) -> int:
    """Decode `out.size` values; OK, or ERR_UNARY if the unary stream does not hold exactly
    that many codes with the last one ending at bit `unary_bits - 1`."""
    k = out.size
    shift = np.uint64(r)
    j = 0
    q = 0
    size = (unary_bits + 7) >> 3
    # 64 bits at a time (most significant first): the loop over a word's one bits ends,
    # with its mispredicted branch, once per word rather than once per byte.
    for first in range(0, size, 8):
        w = np.uint64(0)
        for t in range(min(8, size - first)):
            w |= np.uint64(unary[first + t]) << np.uint64(56 - 8 * t)
        valid = min(64, unary_bits - 8 * first)
        if valid < 64:  # the stream's last bits: padding is not codes
            w &= ~(np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(valid))
        used = 0  # bits of this word consumed so far (cleared from w)
        while w:
            one = leading_zeros(w)  # the next one bit, counted from the word's start
            if j == k:
                return ERR_UNARY
            out[j] = np.uint64(q + one - used) << shift
            j += 1
            q = 0
            used = one + 1
            w ^= np.uint64(1) << np.uint64(63 - one)
        q += valid - used
    if j != k or q != 0:
        return ERR_UNARY
    plane = (k + 7) // 8
    # Up to 8 planes at a time, one value per byte lane: one pass over `out` per 8 planes
    # instead of one per plane.
    for first in range(0, r, 8):
        last = min(first + 8, r)
        for group in range(plane):
            lanes = plane_lanes(low, plane, group, first, last)
            start = group * 8
            for t in range(min(8, k - start)):
                lane = (lanes >> np.uint64(8 * t)) & np.uint64(0xFF)
                out[start + t] |= lane << np.uint64(first)
    return OK


def _apply_steps_py(
    bits: np.ndarray,
    gaps: np.ndarray,
    down: np.ndarray,
    at_gaps: np.ndarray,
    magnitudes: np.ndarray,
    width_bits: int,
) -> int:
    """Move each changed element by its step in float order (`float_order` of `sparse`),
    and overwrite `gaps` with the changes' positions in the block (as int64 bit patterns:
    the caller views the array as int64, no second pass).

    Change i sits `gaps[i]` unchanged elements after change i-1; it moves down if bit i of
    the packed `down` is set, by 1, plus `magnitudes[a] + 1` where it is the a-th change
    `at_gaps` names (gaps in change indices). Returns OK or the error code of the first
    misplaced change.
    """
    n = bits.size
    top = np.uint64(1) << np.uint64(width_bits - 1)
    mask = (top << np.uint64(1)) - np.uint64(1)
    pos = np.int64(-1)
    a = 0
    next_at = np.int64(-1)
    if at_gaps.size:
        if at_gaps[0] >= np.uint64(gaps.size):
            return ERR_MAGNITUDE
        next_at = np.int64(at_gaps[0])
    for i in range(gaps.size):
        g = np.uint64(gaps[i])
        if g >= np.uint64(n):
            return ERR_POSITION
        pos += np.int64(g) + 1
        if pos >= n:
            return ERR_POSITION
        gaps[i] = np.uint64(pos)
        step = np.uint64(1)
        if i == next_at:
            step += np.uint64(magnitudes[a]) + np.uint64(1)
            a += 1
            if a < at_gaps.size:
                g = np.uint64(at_gaps[a])
                if g >= np.uint64(gaps.size):
                    return ERR_MAGNITUDE
                next_at += np.int64(g) + 1
        b = np.uint64(bits[pos])
        # float_order: negative patterns inverted, positive ones get the sign bit set.
        key = b ^ mask if b & top else b ^ top
        # key + step, or key - step for a move down: branch-free, the signs are random.
        sub = np.uint64(0) - np.uint64((down[i >> 3] >> (7 - (i & 7))) & 1)
        key = (key + step - ((step << np.uint64(1)) & sub)) & mask
        bits[pos] = key ^ top if key & top else key ^ mask
    if a != at_gaps.size:
        return ERR_MAGNITUDE
    return OK


def _split_steps_py(
    news: np.ndarray, olds: np.ndarray, width_bits: int, down: np.ndarray, magnitude: np.ndarray
) -> None:
    """down[i] = the change moves down in float order; magnitude[i] = |step| - 1."""
    top = np.uint64(1) << np.uint64(width_bits - 1)
    mask = (top << np.uint64(1)) - np.uint64(1)
    for i in range(news.size):
        a = np.uint64(news[i])
        b = np.uint64(olds[i])
        ka = a ^ mask if a & top else a ^ top
        kb = b ^ mask if b & top else b ^ top
        d = (ka - kb) & mask
        if d & top:
            down[i] = True
            d = (np.uint64(0) - d) & mask
        else:
            down[i] = False
        magnitude[i] = d - np.uint64(1)


RICE_SAMPLE = 1 << 16  # values inspected to pick a Rice parameter
ZSTD_OVERHEAD_BITS = 8 * 48  # frame header and Huffman table of a small zstd frame


def _rice_parameter_py(values: np.ndarray, total: int | np.int64, limit: int) -> int:
    """`bitstreams.rice_parameter`: the r in log2(mean) - 3 .. + 2 (≤ `limit`) whose cost
    k(r+1) + Σ(v >> r) on every (k / 2**16)-th value is least (the smallest r on ties)."""
    k = values.size
    if k == 0:
        return 0
    mean = max(total / k, 1.0)
    centre = max(0, int(np.log2(mean)))
    lo = max(0, centre - 3)
    hi = min(centre + 2, limit)
    if hi < lo:
        return 0
    stride = max(1, k // RICE_SAMPLE)
    costs = np.zeros(hi - lo + 1, np.uint64)
    count = (k + stride - 1) // stride
    # One pass per candidate (at most six): a plain shift-and-sum the compiler vectorises,
    # where updating six costs per value in memory ran at about a value per nanosecond.
    sample = values
    if stride > 1:  # copied once, so that every candidate's pass is contiguous
        sample = np.empty(count, values.dtype)
        for i in range(count):
            sample[i] = values[i * stride]
    for r in range(lo, hi + 1):
        shift = np.uint64(r)
        cost = np.uint64(0)
        for i in range(count):
            cost += np.uint64(sample[i]) >> shift
        costs[r - lo] = cost
    best = lo
    best_cost = np.uint64(count) * np.uint64(lo + 1) + costs[0]
    for r in range(lo + 1, hi + 1):
        cost = np.uint64(count) * np.uint64(r + 1) + costs[r - lo]
        if cost < best_cost:
            best = r
            best_cost = cost
    return best


def _rice_bits_py(values: np.ndarray, total: int | np.int64) -> float:
    """Bits of `values` Rice-coded with the parameter `rice_parameter` picks (limit 62)."""
    r = rice_parameter(values, total, 62)
    bits = np.uint64(values.size) * np.uint64(r + 1)
    for i in range(values.size):
        bits += np.uint64(values[i]) >> np.uint64(r)
    return float(bits)


def _plane_bits_py(values: np.ndarray, width_bits: int) -> float:
    """Estimated bits of the byte planes of `values` as stored: per plane nothing if all
    zero, else its order-0 entropy plus a zstd frame's overhead, or raw if that is less
    (few changes: the entropy of a handful of samples says nothing, raw bytes are what
    gets written)."""
    n = values.size
    total = 0.0
    counts = np.zeros(256, np.int64)
    for j in range(width_bits // 8):
        counts[:] = 0
        for i in range(n):
            counts[(np.uint64(values[i]) >> np.uint64(8 * j)) & np.uint64(0xFF)] += 1
        if counts[0] == n:
            continue
        entropy = 0.0
        for c in counts:
            if c:
                entropy -= c * np.log2(c / n)
        total += min(8.0 * n, entropy + ZSTD_OVERHEAD_BITS)
    return total


def _nonzero_runs_py(magnitude: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.int64]:
    """(gaps between the nonzero magnitudes, each nonzero magnitude - 1, their sum)."""
    k = magnitude.size
    gaps = np.empty(k, np.uint32)
    values = np.empty(k, np.uint64)
    m = 0
    last = -1
    total = np.int64(0)
    for i in range(k):
        if magnitude[i]:
            gaps[m] = i - last - 1
            values[m] = np.uint64(magnitude[i]) - np.uint64(1)
            total += np.int64(values[m])
            last = i
            m += 1
    return gaps[:m], values[:m], total


def _mode_bits_py(new: np.ndarray, old: np.ndarray, width_bits: int, out: np.ndarray) -> None:
    """Estimated bits of each value representation of the changes (new[i] != old[i]):
    out[0] storing the new bits, out[1] new XOR old, out[2] the step (a sign per change
    plus Rice-coded positions and values of the magnitudes that are not zero)."""
    k = new.size
    down = np.empty(k, np.bool_)
    magnitude = np.empty(k, np.uint64)
    split_steps(new, old, width_bits, down, magnitude)
    gaps, values, value_total = nonzero_runs(magnitude)
    step = float(k)
    if gaps.size:
        step += rice_bits(gaps, k) + rice_bits(values, value_total)
    out[0] = plane_bits(new, width_bits)
    out[1] = plane_bits(new ^ old, width_bits)
    out[2] = step


gather_changes = _jit(_gather_changes_py)
change_mask = _jit(_change_mask_py)
rice_parameter = _jit(_rice_parameter_py)
rice_bits = _jit(_rice_bits_py)
plane_bits = _jit(_plane_bits_py)
rice_pack = _jit(_rice_pack_py)
plane_lanes = _jit(_plane_lanes_py)
rice_unpack = _jit(_rice_unpack_py)
apply_steps = _jit(_apply_steps_py)
split_steps = _jit(_split_steps_py)
nonzero_runs = _jit(_nonzero_runs_py)
mode_bits = _jit(_mode_bits_py)
