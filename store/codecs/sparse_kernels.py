"""The compiled inner loops of `sparse-v2`: finding changes, Rice packing, applying steps.

Owns the numba kernels over one block of elements (unsigned ints of the element width).
As chains of numpy passes (compare, flatnonzero, diff, gather, per-plane packbits, cumsum,
scatter) each changed element was read and written ten to twenty times, which held encode
near 0.6 and apply near 1.4 GB/s per core at 10 % density; one pass per stream keeps each
element in registers, and a STEP block's gaps are decoded and applied by one kernel
(`rice_apply_steps`) in chunks that stay in L1. The kernels release the GIL (`nogil`), so
the codec's thread pools run blocks and tensors on every core.

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
from llvmlite import ir
from numba.core import types
from numba.cpython.unsafe.numbers import leading_zeros as _leading_zeros
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros
from numba.extending import intrinsic

# cache=True: compiled once per machine (about a second per element width), not per process.
_jit = numba.njit(cache=True, nogil=True)

# Bit-scan intrinsics (one instruction each); typed Any as their Python signature is the
# compiler's, not the call's.
trailing_zeros: Any = _trailing_zeros
leading_zeros: Any = _leading_zeros


def read_only(array: np.ndarray) -> np.ndarray:
    """`array` as a read-only view, for a kernel argument it only reads. A kernel is
    compiled (or loaded from numba's cache) once per argument type, and an array's type
    includes whether it is writable: a stream stored raw in a writable payload and one
    decompressed into bytes, or a base loaded read-only and a block's own buffer, are two
    types. Decoders hand every array a kernel reads as read-only, so each kernel has one
    type per element width, the one `store.codecs.warm` loads at boot."""
    view = array.view()
    view.flags.writeable = False
    return view


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
    # Unsigned indices: a signed one costs negative-index wraparound code on every access.
    j = np.uint64(0)
    after = np.uint64(0)  # one past the last change
    for w in range(changed.size):
        m = changed[w]
        start = np.uint64(w * 64)
        while m:
            i = start + np.uint64(trailing_zeros(m))
            m &= m - np.uint64(1)
            gaps[j] = i - after
            news[j] = new[i]
            olds[j] = old[i]
            after = i + np.uint64(1)
            j += np.uint64(1)


def _differ_word(typingctx: Any, new: Any, old: Any, at: Any) -> Any:
    """Bit t = new[at + t] != old[at + t] for t < 64: one LLVM vector compare of 64 lanes
    (two loads, a compare, the 64 compare bits taken as an integer), which the backend
    lowers to SIMD compares and movemasks on any x86 (mask registers with AVX-512)."""
    if (
        not all(
            isinstance(a, types.Array) and a.layout == "C" and isinstance(a.dtype, types.Integer)
            for a in (new, old)
        )
        or new.dtype != old.dtype
    ):
        return None
    bits = new.dtype.bitwidth
    signature = types.uint64(new, old, types.intp)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        a, b, start = args
        vector = ir.VectorType(ir.IntType(bits), 64)

        def load(array: Any, kind: Any) -> Any:
            data = context.make_array(kind)(context, builder, array).data
            pointer = builder.bitcast(builder.gep(data, [start]), vector.as_pointer())
            return builder.load(pointer, align=bits // 8)

        differ = builder.icmp_unsigned("!=", load(a, sig.args[0]), load(b, sig.args[1]))
        return builder.bitcast(differ, ir.IntType(64))

    return signature, codegen


differ_word: Any = intrinsic(_differ_word)


def _popcount(x: np.uint64) -> int:
    """Set bits of a word (SWAR; LLVM turns it into one popcnt)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return int((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


popcount = _jit(_popcount)


def _change_mask_py(new: np.ndarray, old: np.ndarray, words: np.ndarray) -> int:
    """Fill `words` with the block's change mask for `gather_changes` (bit t of word w set
    iff element 64w + t changed); return how many changed.

    Each full word is one vector compare of 64 elements (`differ_word`) and a popcount;
    the last partial word, if any, a scalar loop. (Byte flags packed eight at a time by a
    multiply cost about 0.3 ns per element; numpy's not_equal + count_nonzero + packbits
    were four passes and three block-sized allocations.)
    """
    full = new.size // 64
    total = 0
    for w in range(full):
        bits = differ_word(new, old, 64 * w)
        words[w] = bits
        total += popcount(bits)
    if new.size > 64 * full:
        bits = np.uint64(0)
        for t in range(new.size - 64 * full):
            i = 64 * full + t
            bits |= np.uint64(new[i] != old[i]) << np.uint64(t)
        words[full] = bits
        total += popcount(bits)
    return total


def _rice_pack_py(values: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray, np.int64]:
    """(low planes, unary stream, unary bit count) of `values` Rice-coded with parameter r:
    r planes of ceil(k/8) bytes, then each quotient as q zero bits and a one."""
    k = values.size
    bits = np.int64(k)
    for i in range(k):
        bits += np.int64(np.uint64(values[i]) >> np.uint64(r))
    unary = np.zeros((bits + 7) // 8, np.uint8)
    bit = np.uint64(0)  # unsigned: no negative-index wraparound code
    for i in range(k):
        bit += np.uint64(values[i]) >> np.uint64(r)
        unary[bit >> np.uint64(3)] |= np.uint8(np.uint64(0x80) >> (bit & np.uint64(7)))
        bit += np.uint64(1)
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


def _byte_tables() -> tuple[np.ndarray, np.ndarray]:
    """(each byte with its bits reversed, each byte spread to 8 lanes of 0/1: lane t of
    byte b holds bit 7 - t, the bit of value t of a low plane's group)."""
    reverse = np.zeros(256, np.uint64)
    lanes = np.zeros(256, np.uint64)
    for b in range(256):
        for t in range(8):
            bit = (b >> (7 - t)) & 1
            reverse[b] |= bit << t
            lanes[b] |= bit << (8 * t)
    return reverse, lanes


_REVERSED, _LANES = _byte_tables()


def _unary_decode_py(unary: np.ndarray, unary_bits: int, r: int, out: np.ndarray) -> int:
    """Fill `out` with the quotients of the unary stream shifted left by r; OK, or
    ERR_UNARY if the stream does not hold exactly `out.size` codes with the last one ending
    at bit `unary_bits - 1`.

    64 bits at a time, bit-reversed into a word whose bit 0 is the stream's first bit, so
    each code is found with a trailing-zero count and cleared with `w & (w - 1)`: one cycle
    of dependency between codes, where clearing the leading one (count, shift, xor) chained
    about five. The loop over a word's one bits exits, mispredicted, once per word.
    """
    k = np.uint64(out.size)
    shift = np.uint64(r)
    j = np.uint64(0)  # unsigned indices: no negative-index wraparound code
    begin = np.int64(0)  # where the current code started, relative to this word's first bit
    size = (unary_bits + 7) >> 3
    for first in range(0, size, 8):
        w = np.uint64(0)
        for t in range(min(8, size - first)):
            w |= _REVERSED[unary[first + t]] << np.uint64(8 * t)
        valid = min(64, unary_bits - 8 * first)
        if valid < 64:  # the stream's last bits: padding is not codes
            w &= (np.uint64(1) << np.uint64(valid)) - np.uint64(1)
        while w:
            if j == k:
                return ERR_UNARY
            one = np.int64(trailing_zeros(w))
            out[j] = np.uint64(one - begin) << shift
            begin = one + 1
            w &= w - np.uint64(1)
            j += np.uint64(1)
        begin -= valid
    if j != k or begin != 0:
        return ERR_UNARY
    return OK


def _merge_planes_py(low: np.ndarray, first: int, r: int, out: np.ndarray) -> None:
    """OR bits `first`..r-1 of each value, from the low planes of `rice_pack`, into `out`.

    Up to 8 planes at a time, one value per byte lane: each plane byte becomes its group's
    8 lanes by one table load (`_LANES`), shifted to its plane's bit.
    """
    k = out.size
    plane = (k + 7) // 8
    for chunk in range(first, r, 8):
        last = min(chunk + 8, r)
        for group in range(plane):
            lanes = np.uint64(0)
            for jj in range(chunk, last):
                lanes |= _LANES[low[jj * plane + group]] << np.uint64(jj - chunk)
            start = np.uint64(group * 8)
            for t in range(min(8, k - group * 8)):
                lane = (lanes >> np.uint64(8 * t)) & np.uint64(0xFF)
                out[start + np.uint64(t)] |= lane << np.uint64(chunk)


def _rice_unpack_py(
    low: np.ndarray, unary: np.ndarray, unary_bits: int, r: int, out: np.ndarray
) -> int:
    """Decode `out.size` values; OK, or ERR_UNARY if the unary stream does not hold exactly
    that many codes with the last one ending at bit `unary_bits - 1`."""
    error = unary_decode(unary, unary_bits, r, out)
    if error == OK:
        merge_planes(low, 0, r, out)
    return error


def _step_one_py(b: np.uint64, down: np.uint64, high: np.uint64) -> np.uint64:
    """`b` (an element of width high + 1 bits) moved one unit up, or down if `down` is 1,
    in float order (`float_order` of `sparse`), without branches (the signs of weights and
    of steps are random: a branch on either mispredicts half the time).

    In float order a positive pattern moves by +1 for up and a negative one by -1 (it is
    stored as its magnitude); so b + 1 - 2 * (sign XOR down), unless that changes the sign
    bit: only from ±0 towards the other zero, or from the largest pattern of a sign
    (±NaN) round to the other sign's, and there the other bits must be inverted too.
    """
    top = np.uint64(1) << high
    below = top - np.uint64(1)
    mask = below | top
    x = (b >> high) ^ down
    moved = (b + np.uint64(1) - (x << np.uint64(1))) & mask
    flipped = ((moved ^ b) >> high) & np.uint64(1)
    return moved ^ ((np.uint64(0) - flipped) & below)


_WALK_CHUNK = 1024  # changes per chunk of `rice_apply_steps`: 8 KB of positions, in L1
# Elements `rice_apply_steps` copies from its source at a time, at least: few enough that
# the stretch is still in L1 when the steps in it land, enough that a copy's setup is rare.
_FILL = np.uint64(4096)


def _rice_apply_steps_py(
    bits: np.ndarray,
    source: np.ndarray,
    fill: bool,
    low: np.ndarray,
    unary: np.ndarray,
    unary_bits: int,
    r: int,
    down: np.ndarray,
    at_gaps: np.ndarray,
    magnitudes: np.ndarray,
    width_bits: int,
    positions: np.ndarray,
) -> int:
    """Decode a STEP block's Rice-coded gaps and move each changed element of `bits` by its
    step in float order (`float_order` of `sparse`); fill `positions` (one per change, as
    uint64 bit patterns of int64: the caller views it as int64) with the changes' positions.
    With `fill`, `bits` starts uninitialised and `source` (the same size) holds the block's
    previous state: the walk copies it ahead of its steps, at least `_FILL` elements at a
    time and the rest after the last change, so the steps patch lines still in L1 and the
    block is read and written once (after a separate copy of a block larger than L2, the
    walk found most of it back in L3 or memory).

    Change i sits gap i unchanged elements after change i-1 and moves down if bit i of the
    packed `down` is set, by 1, plus `magnitudes[a] + 1` where it is the a-th change
    `at_gaps` names (gaps in change indices). Returns OK or the first error code.

    Per chunk of 1,024 changes, whose 8 KB of positions stay in L1 from one loop to the
    next: the unary codes into `positions`, their low bits (up to 8 planes per group of 8
    changes, one table load per plane), the running sum, and the one-unit steps. The few
    larger magnitudes are added afterwards: float order is a bijection and steps add modulo
    2**width, so a step of 1 then one of m + 1 is a step of m + 2. Positions are written
    once, where the old two kernels wrote gaps, reread them and wrote positions over them.
    """
    n = bits.size
    k = positions.size
    size = (unary_bits + 7) >> 3
    # Every position below is at most (unary_bits + k) << r + k: refuse what could wrap, so
    # that the per-chunk check below bounds every write (a valid block is far below this).
    if (np.uint64(unary_bits + k) >> np.uint64(63 - r)) != np.uint64(0):
        return ERR_POSITION
    if r > 8:  # planes past the first 8 (gaps this long are rare: few changes)
        error = unary_decode(unary, unary_bits, r, positions)
        if error != OK:
            return error
        merge_planes(low, 8, r, positions)
    near = min(r, 8)
    shift = np.uint64(r)
    plane = (k + 7) // 8
    high = np.uint64(width_bits - 1)
    top = np.uint64(1) << high
    mask = (top << np.uint64(1)) - np.uint64(1)
    below = top - np.uint64(1)
    limit = np.uint64(n)
    after = np.uint64(0)  # one past the last change's position
    copied = np.uint64(0)  # with `fill`: the elements of `source` copied so far
    # The unary decoder's state between chunks: the next byte to load, the current word
    # (codes already taken cleared), its valid bits, where the current code started.
    at = 0
    w = np.uint64(0)
    valid = np.int64(0)
    begin = np.int64(0)
    for chunk in range(0, k, _WALK_CHUNK):
        stop = min(k, chunk + _WALK_CHUNK)
        if r <= 8:  # the quotients of this chunk, into memory that stays in L1 for the walk
            j = np.uint64(chunk)  # unsigned indices: no negative-index wraparound code
            end = np.uint64(stop)
            while j < end:
                if not w:
                    if at >= size:
                        return ERR_UNARY
                    begin -= valid
                    for t in range(min(8, size - at)):
                        w |= _REVERSED[unary[at + t]] << np.uint64(8 * t)
                    valid = np.int64(min(64, unary_bits - 8 * at))
                    if valid < 64:  # the stream's last bits: padding is not codes
                        w &= (np.uint64(1) << np.uint64(valid)) - np.uint64(1)
                    at += 8
                    continue
                one = np.int64(trailing_zeros(w))
                positions[j] = np.uint64(one - begin) << shift
                begin = one + 1
                w &= w - np.uint64(1)
                j += np.uint64(1)
        # Four short loops per chunk rather than one: with every stage's state live at
        # once the compiler kept the running position on the stack, and its store and
        # reload (about 6 cycles) chained every change to the one before.
        for group in range(chunk // 8, (stop + 7) // 8):
            lanes = np.uint64(0)
            for jj in range(near):
                lanes |= _LANES[low[jj * plane + group]] << np.uint64(jj)
            start = np.uint64(group * 8)
            if group * 8 + 8 <= stop:  # a loop of fixed length, unrolled
                for t in range(8):
                    positions[start + np.uint64(t)] |= (lanes >> np.uint64(8 * t)) & np.uint64(0xFF)
            else:
                for t in range(stop - group * 8):
                    positions[start + np.uint64(t)] |= (lanes >> np.uint64(8 * t)) & np.uint64(0xFF)
        # Positions only grow and cannot wrap (checked above): one bound check per chunk.
        for i in range(np.uint64(chunk), np.uint64(stop)):
            after += np.uint64(positions[i]) + np.uint64(1)
            positions[i] = after - np.uint64(1)
        if after > limit:
            return ERR_POSITION
        for group in range(chunk // 8, (stop + 7) // 8):
            signs = np.uint64(down[group])
            first = np.uint64(group * 8)
            if fill:  # copy ahead of this group's last change, at least _FILL elements
                last = np.uint64(positions[min(np.uint64(stop), first + np.uint64(8)) - 1])
                if last >= copied:
                    upto = min(limit, max(last + np.uint64(1), copied + _FILL))
                    for e in range(copied, upto):
                        bits[e] = source[e]
                    copied = upto
            if first + np.uint64(8) <= np.uint64(stop):  # a loop of fixed length, unrolled
                for t in range(8):
                    p = np.uint64(positions[first + np.uint64(t)])
                    b = np.uint64(bits[p])
                    bits[p] = step_one(b, (signs >> np.uint64(7 - t)) & np.uint64(1), high)
            else:
                for t in range(stop - group * 8):
                    p = np.uint64(positions[first + np.uint64(t)])
                    b = np.uint64(bits[p])
                    bits[p] = step_one(b, (signs >> np.uint64(7 - t)) & np.uint64(1), high)
    # Exactly k codes, the last ending at the stream's last bit.
    if r <= 8 and (w or at < size or begin != valid):
        return ERR_UNARY
    if fill:
        for e in range(copied, limit):
            bits[e] = source[e]
    index = np.int64(-1)
    for a in range(at_gaps.size):
        g = np.uint64(at_gaps[a])
        if g >= np.uint64(k):
            return ERR_MAGNITUDE
        index += np.int64(g) + 1
        if index >= k:
            return ERR_MAGNITUDE
        pos = np.uint64(positions[index])
        step = np.uint64(magnitudes[a]) + np.uint64(1)
        sub = np.uint64(0) - np.uint64((down[index >> 3] >> (7 - (index & 7))) & 1)
        b = np.uint64(bits[pos])
        # float_order and back, without branches (random signs), as in `step_one`.
        key = b ^ (top | ((np.uint64(0) - (b >> high)) & below))
        key = (key + step - ((step << np.uint64(1)) & sub)) & mask
        bits[pos] = key ^ (top | (((key >> high) - np.uint64(1)) & below))
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
unary_decode = _jit(_unary_decode_py)
merge_planes = _jit(_merge_planes_py)
rice_unpack = _jit(_rice_unpack_py)
step_one = _jit(_step_one_py)
rice_apply_steps = _jit(_rice_apply_steps_py)
split_steps = _jit(_split_steps_py)
nonzero_runs = _jit(_nonzero_runs_py)
mode_bits = _jit(_mode_bits_py)
