"""The compiled inner loops of `sparse-v3`: positions counted within classes of the base.

Owns the numba kernels that `sparse_v3` builds its position streams with: class bit masks
(which elements of a block have a base value whose magnitude key lies in a range), the
changes' gaps counted among one class's elements and their inverse, the sampled counts the
encoder picks classes from, and the choice of classes itself. A class mask is one
vectorised compare per element (about 0.1 ns per element per class, the same code the
compiler turns into SIMD compares), and a class's gaps are walked with a popcount per
64-element word and a bit scan per change, never a branch per element, so a class-coded
block applies at memory speed plus about n/64 popcounts per class.

Kernels never raise: decoders return an error code that `sparse_v3` turns into
`CorruptPayload`. They never interpret payload headers or allocate per element.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from store.codecs.sparse_kernels import leading_zeros, trailing_zeros

_jit = numba.njit(cache=True, nogil=True)

OK = 0
ERR_EVENTS = 1  # a class's gaps run past the last element of the class


def _class_mask_py(bits: np.ndarray, keymask: int, lo: int, width: int, out: np.ndarray) -> None:
    """Bit i of `out` (64 elements per little-endian word) = lo <= (bits[i] & keymask) < lo +
    width, compared as unsigned integers (so lo + width may pass the largest key)."""
    n = bits.size
    full = n // 64
    km = np.uint64(keymask)
    low = np.uint64(lo)
    wide = np.uint64(width)
    for w in range(full):
        m = np.uint64(0)
        base = w * 64
        for t in range(64):
            v = (np.uint64(bits[base + t]) & km) - low
            m |= np.uint64(v < wide) << np.uint64(t)
        out[w] = m
    if n > full * 64:
        m = np.uint64(0)
        for t in range(n - full * 64):
            v = (np.uint64(bits[full * 64 + t]) & km) - low
            m |= np.uint64(v < wide) << np.uint64(t)
        out[full] = m


def _changed_mask_py(new: np.ndarray, old: np.ndarray, out: np.ndarray) -> None:
    """Bit i of `out` = new[i] != old[i], 64 elements per word."""
    n = new.size
    full = n // 64
    for w in range(full):
        m = np.uint64(0)
        base = w * 64
        for t in range(64):
            m |= np.uint64(new[base + t] != old[base + t]) << np.uint64(t)
        out[w] = m
    if n > full * 64:
        m = np.uint64(0)
        for t in range(n - full * 64):
            m |= np.uint64(new[full * 64 + t] != old[full * 64 + t]) << np.uint64(t)
        out[full] = m


def _popcount(x: np.uint64) -> int:
    """Set bits of a word (SWAR; LLVM turns it into one popcnt)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return int((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


popcount = _jit(_popcount)


def _encode_events_py(
    mask: np.ndarray, changed: np.ndarray, complement: bool, gaps: np.ndarray
) -> int:
    """Fill `gaps` with the events of one class and return their count: an event is a
    class element that changed (or, with `complement`, one that did not); its gap is the
    number of class elements since the previous event (or the block's start)."""
    j = 0
    run = 0  # class elements seen since the last event
    for w in range(mask.size):
        m = mask[w]
        e = m & (~changed[w] if complement else changed[w])
        while e:
            low = e & (np.uint64(0) - e)
            gaps[j] = run + popcount(m & (low - np.uint64(1)))
            j += 1
            run = 0
            m &= ~(low | (low - np.uint64(1)))
            e &= e - np.uint64(1)
        run += popcount(m)
    return j


def _decode_events_py(
    mask: np.ndarray, gaps: np.ndarray, complement: bool, changed: np.ndarray
) -> int:
    """Inverse of `encode_events`: mark the class's changed elements in `changed` (set the
    events' bits, or with `complement` set the whole class and clear the events'). Returns
    OK, or ERR_EVENTS if a gap runs past the class's last element."""
    words = mask.size
    if complement:
        for w in range(words):
            changed[w] |= mask[w]
    w = 0
    m = mask[0] if words else np.uint64(0)
    for i in range(gaps.size):
        g = np.uint64(gaps[i])
        count = np.uint64(popcount(m))
        while count <= g:  # skip whole words: one popcount each
            g -= count
            w += 1
            if w >= words:
                return ERR_EVENTS
            m = mask[w]
            count = np.uint64(popcount(m))
        while g:  # then the g class elements before the event inside this word
            m &= m - np.uint64(1)
            g -= np.uint64(1)
        low = m & (np.uint64(0) - m)
        if complement:
            changed[w] &= ~low
        else:
            changed[w] |= low
        m &= m - np.uint64(1)
    return OK


def _positions_py(words: np.ndarray, out: np.ndarray) -> int:
    """Write the index of each set bit of `words` to `out` (at most out.size of them) and
    return how many there are."""
    j = 0
    for w in range(words.size):
        m = words[w]
        start = w * 64
        while m:
            if j < out.size:
                out[j] = start + trailing_zeros(m)
            m &= m - np.uint64(1)
            j += 1
    return j


def _rice_bits_py(
    low: np.ndarray,
    low_at: int,
    unary: np.ndarray,
    unary_at: int,
    unary_end: int,
    r: int,
    out: np.ndarray,
) -> int:
    """Decode out.size Rice codes whose low bits are r planes of out.size bits each from
    bit `low_at` of `low`, and whose unary codes start at bit `unary_at` of `unary` (bits
    most significant first). Returns the bit after the last code, or -1 if the codes run
    past `unary_end`."""
    k = out.size
    pos = unary_at
    for i in range(k):
        q = 0
        while True:  # a byte at a time: the next one bit by a leading-zero count
            if pos >= unary_end:
                return -1
            skip = pos & 7
            b = (np.uint32(unary[pos >> 3]) << np.uint32(skip)) & np.uint32(0xFF)
            if b == 0:
                q += 8 - skip
                pos += 8 - skip
                continue
            zeros = leading_zeros(np.uint8(b))
            q += zeros
            pos += zeros + 1
            break
        if pos > unary_end:
            return -1
        out[i] = np.uint64(q) << np.uint64(r)
    for j in range(r):
        base = low_at + j * k
        for i in range(k):
            at = base + i
            out[i] |= np.uint64((low[at >> 3] >> (7 - (at & 7))) & 1) << np.uint64(j)
    return pos


def _apply_class_steps_py(
    bits: np.ndarray,
    own: np.ndarray,
    down: np.ndarray,
    index: np.ndarray,
    magnitudes: np.ndarray,
    width_bits: int,
) -> int:
    """Move every change by its step in float order, in one pass in element order.

    Row c of `own` marks class c's changes. Values are stored class by class, so the t-th
    change of class c is change starts[c] + t of that order: its sign is that bit of `down`
    (1 = down), and it moves by magnitudes[a] + 2 instead of 1 where index[a] (ascending)
    names it. Returns OK, or ERR_EVENTS if a magnitude's index is never reached."""
    top = np.uint64(1) << np.uint64(width_bits - 1)
    mask = (top << np.uint64(1)) - np.uint64(1)
    classes, words = own.shape
    next_of = class_starts(own)  # class c's next change, in stored order
    next_at = np.zeros(classes, np.int64)  # its first magnitude index not yet used
    for c in range(classes):
        start = next_of[c]
        lo = 0
        hi = index.size
        while lo < hi:  # first magnitude index >= start
            mid = (lo + hi) // 2
            if index[mid] < np.uint64(start):
                lo = mid + 1
            else:
                hi = mid
        next_at[c] = lo
    used = 0
    for w in range(words):
        for c in range(classes):
            m = own[c, w]
            while m:
                pos = w * 64 + trailing_zeros(m)
                m &= m - np.uint64(1)
                j = next_of[c]
                next_of[c] = j + 1
                step = np.uint64(1)
                a = next_at[c]
                if a < index.size and index[a] == np.uint64(j):
                    step += np.uint64(magnitudes[a]) + np.uint64(1)
                    next_at[c] = a + 1
                    used += 1
                b = np.uint64(bits[pos])
                key = b ^ mask if b & top else b ^ top
                sub = np.uint64(0) - np.uint64((down[j >> 3] >> (7 - (j & 7))) & 1)
                key = (key + step - ((step << np.uint64(1)) & sub)) & mask
                bits[pos] = key ^ top if key & top else key ^ mask
    return OK if used == index.size else ERR_EVENTS


def _class_starts(own: np.ndarray) -> np.ndarray:
    """Where each class's changes begin in the class-by-class order (row c of `own` marks
    class c's changes)."""
    classes, words = own.shape
    starts = np.zeros(classes, np.int64)
    total = 0
    for c in range(classes):
        starts[c] = total
        for w in range(words):
            total += popcount(own[c, w])
    return starts


class_starts = _jit(_class_starts)


def _apply_class_patches_py(
    bits: np.ndarray, own: np.ndarray, values: np.ndarray, xor: bool
) -> None:
    """Write (or XOR in) `values`, stored class by class, at the changes `own` marks, in
    one pass in element order."""
    classes, words = own.shape
    next_of = class_starts(own)
    for w in range(words):
        for c in range(classes):
            m = own[c, w]
            while m:
                pos = w * 64 + trailing_zeros(m)
                m &= m - np.uint64(1)
                j = next_of[c]
                next_of[c] = j + 1
                if xor:
                    bits[pos] ^= values[j]
                else:
                    bits[pos] = values[j]


def _key_counts_py(
    bits: np.ndarray, keymask: int, shift: int, stride: int, counts: np.ndarray
) -> None:
    """counts[b] += 1 for the bin b = (x & keymask) >> shift of every `stride`-th element."""
    km = np.uint64(keymask)
    sh = np.uint64(shift)
    for i in range(0, bits.size, stride):
        counts[(np.uint64(bits[i]) & km) >> sh] += 1


def _h2_bits(n: float, k: float) -> float:
    """n · H2(k/n): the bits of k changes among n elements at order 0."""
    if k <= 0.0 or k >= n:
        return 0.0
    p = k / n
    return -n * (p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))


h2_bits = _jit(_h2_bits)


def _choose_classes_py(
    elements: np.ndarray,
    changes: np.ndarray,
    max_classes: int,
    max_live: int,
    live_bits: float,
    class_bits: float,
    starts: np.ndarray,
) -> tuple[int, float]:
    """Cut the bins into at most `max_classes` contiguous classes minimising the estimated
    position bits: per class with changes n·H2(k/n) plus `live_bits` (its header and its
    mask pass), per class `class_bits` (its threshold); at most `max_live` classes with
    changes. Writes the first bin of each class to `starts`; returns (classes, bits)."""
    bins = np.flatnonzero(elements)
    m = bins.size
    if m == 0:
        starts[0] = 0
        return 1, 0.0
    n_sum = np.zeros(m + 1)
    k_sum = np.zeros(m + 1)
    for j in range(m):
        n_sum[j + 1] = n_sum[j] + elements[bins[j]]
        k_sum[j + 1] = k_sum[j] + changes[bins[j]]
    big = 1e300
    # best[c, l, i]: first i bins in c + 1 classes of which l are live.
    best = np.full((max_classes, max_live + 1, m + 1), big)
    back = np.zeros((max_classes, max_live + 1, m + 1), np.int64)
    for i in range(1, m + 1):
        k = k_sum[i]
        if k > 0:
            if max_live >= 1:
                best[0, 1, i] = h2_bits(n_sum[i], k) + live_bits + class_bits
        else:
            best[0, 0, i] = class_bits
    for c in range(1, max_classes):
        for live in range(max_live + 1):
            for i in range(c + 1, m + 1):
                for j in range(c, i):
                    k = k_sum[i] - k_sum[j]
                    if k > 0:
                        if live == 0:
                            continue
                        prev = best[c - 1, live - 1, j]
                        cost = h2_bits(n_sum[i] - n_sum[j], k) + live_bits
                    else:
                        prev = best[c - 1, live, j]
                        cost = 0.0
                    total = prev + cost + class_bits
                    if total < best[c, live, i]:
                        best[c, live, i] = total
                        back[c, live, i] = j
    best_c, best_l, best_bits = 0, 0, big
    for c in range(max_classes):
        for live in range(max_live + 1):
            if best[c, live, m] < best_bits:
                best_c, best_l, best_bits = c, live, best[c, live, m]
    i, live = m, best_l
    for c in range(best_c, 0, -1):
        j = back[c, live, i]
        if k_sum[i] - k_sum[j] > 0:
            live -= 1
        starts[c] = bins[j]
        i = j
    starts[0] = 0
    return best_c + 1, best_bits


class_mask = _jit(_class_mask_py)
changed_mask = _jit(_changed_mask_py)
encode_events = _jit(_encode_events_py)
decode_events = _jit(_decode_events_py)
positions = _jit(_positions_py)
rice_bits = _jit(_rice_bits_py)
apply_class_steps = _jit(_apply_class_steps_py)
apply_class_patches = _jit(_apply_class_patches_py)
key_counts = _jit(_key_counts_py)
choose_classes = _jit(_choose_classes_py)
