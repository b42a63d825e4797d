"""The compiled inner loops of `sparse-v3`: positions counted within classes of the base.

Owns the numba kernels that `sparse_v3` builds and reads its class-form blocks with: the
classes' member masks (which elements of a block have a base value whose magnitude key lies
in a class's range), the encoder's one classification pass (`class_census`) and one walk
(`class_events`: every class's gaps and its values in class order), the decoder's single
pass (`apply_classes`: masks, events and values together), the sampled counts the encoder
picks classes from, and the choice of classes itself.

The block is read once per pass whatever the number of classes: per 4096-element chunk
every class's masks are built with one vector compare per 64 elements (`word_mask`, about
0.03 ns per element per class) while the chunk is in L1. A class's events are set in a
bitmap by their rank among its members (each rank the previous one plus its gap plus one)
and deposited on each word's members at once (`deposit`: x86 BMI2 pdep through its LLVM
intrinsic where it is fast; elsewhere a broadword `select64` per event). A chunk's changes
are listed by index with two AVX-512 compresses per word where the CPU has them
(`list_bits`; elsewhere bit scans, four per step).

Kernels never raise: decoders return an error code that `sparse_v3` turns into
`CorruptPayload`. They never interpret payload headers or allocate per element.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from store.codecs.sparse_kernels import (
    leading_zeros,
    popcount,
    rice_pack,
    rice_parameter,
    trailing_zeros,
)

_jit = numba.njit(cache=True, nogil=True)

OK = 0
ERR_EVENTS = 1  # a class's gaps run past the last element of the class


def _select_table() -> np.ndarray:
    """SELECT_IN_BYTE[8 * b + r]: the bit index of the r-th (from 0) set bit of byte b."""
    table = np.zeros(256 * 8, np.uint8)
    for b in range(256):
        rank = 0
        for bit in range(8):
            if b >> bit & 1:
                table[8 * b + rank] = bit
                rank += 1
    return table


SELECT_IN_BYTE = _select_table()
_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)


def _select64_py(x: np.uint64, r: np.uint64) -> int:
    """The index of the r-th (from 0) set bit of `x`, for r < popcount(x).

    Broadword select without pdep: byte popcounts, their running sums in one multiply, the
    byte holding the bit by comparing every sum with r at once (a sum is at most 64, so the
    byte lanes never borrow from each other), then a table within that byte. A handful of
    instructions and one table load, where clearing r bits one by one cost a dependent
    loop of up to 63 steps per event.
    """
    s = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    s = (s & np.uint64(0x3333333333333333)) + ((s >> np.uint64(2)) & np.uint64(0x3333333333333333))
    s = (s + (s >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    sums = s * _ONES  # byte i: set bits in bytes 0..i
    below = (((r * _ONES) | _HIGHS) - sums) & _HIGHS  # byte i's top bit: sums_i <= r
    place = ((below >> np.uint64(7)) * _ONES) >> np.uint64(56) << np.uint64(3)
    before = ((sums << np.uint64(8)) >> place) & np.uint64(0xFF)
    byte = (x >> place) & np.uint64(0xFF)
    return int(place) + int(SELECT_IN_BYTE[byte * np.uint64(8) + r - before])


select64 = _jit(_select64_py)


def _bmi2_intrinsic(name: str) -> Any:
    """`name(src, mask)` as the x86 BMI2 instruction (pdep: one instruction of three
    cycles on the CPUs it is used on), through its LLVM intrinsic, as `word_mask` emits
    vector compares."""

    def typer(typingctx: Any, src: Any, mask: Any) -> Any:
        if not (isinstance(src, types.Integer) and isinstance(mask, types.Integer)):
            return None
        signature = types.uint64(types.uint64, types.uint64)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            word = ir.IntType(64)
            symbol = f"llvm.x86.bmi.{name}.64"
            function = builder.module.globals.get(symbol) or ir.Function(
                builder.module, ir.FunctionType(word, [word, word]), symbol
            )
            return builder.call(function, list(args))

        return signature, codegen

    return intrinsic(typer)


def _deposit_py(x: np.uint64, m: np.uint64) -> np.uint64:
    """The low bits of `x` placed, in order, on the set bits of `m` (pdep): one select per
    set bit of x, for CPUs without a fast pdep."""
    out = np.uint64(0)
    x = np.uint64(x)
    count = popcount(m)
    if count < 64:  # pdep reads only as many bits of x as m has
        x &= (np.uint64(1) << np.uint64(count)) - np.uint64(1)
    while x:
        out |= np.uint64(1) << np.uint64(select64(m, trailing_zeros(x)))
        x &= x - np.uint64(1)
    return out


# What this CPU runs, read once: the kernels below are chosen per machine from it.
_HOST_FEATURES = llvm.get_host_cpu_features()


def _fast_bmi2() -> bool:
    """Whether this CPU has BMI2 with a fast pdep/pext. AMD before Zen 3 runs them in
    microcode (up to hundreds of cycles, worse than the broadword select), so they are
    used only where they are single instructions."""
    return bool(_HOST_FEATURES.get("bmi2")) and llvm.get_host_cpu_name() not in _SLOW_PDEP


_SLOW_PDEP = {"znver1", "znver2", "bdver4", "bdver3", "bdver2", "bdver1", "btver2"}
FAST_BMI2 = _fast_bmi2()
# Which deposit the compiled kernels call is fixed per machine, as numba's cache is (its
# index holds the CPU name and features).
deposit: Any = _bmi2_intrinsic("pdep") if FAST_BMI2 else _jit(_deposit_py)

CHUNK = 4096  # elements classified per step: their masks stay in L1 while walked


def _word_mask(typingctx: Any, keys: Any, at: Any, keymask: Any, lo: Any, width: Any) -> Any:
    """Bit t = lo <= (keys[at + t] & keymask) < lo + width for t < 64, compared in the
    elements' own width (the difference wraps, so one unsigned compare tests both ends).

    Written as one LLVM vector operation (64 loads, and, subtract, compare, then the 64
    compare bits taken as an integer), which the backend lowers to SIMD compares and
    movemasks: about 0.03 ns per element per class here, where a scalar loop packing
    its bits (or byte flags packed by multiplies) cost 0.1.
    """
    if (
        not isinstance(keys, types.Array)
        or keys.layout != "C"
        or not isinstance(keys.dtype, types.Integer)
    ):
        return None
    element: Any = keys.dtype
    bits = element.bitwidth
    signature = types.uint64(keys, types.intp, element, element, element)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        array, start, mask, low, wide = args
        data = context.make_array(sig.args[0])(context, builder, array).data
        vector = ir.VectorType(ir.IntType(bits), 64)
        pointer = builder.bitcast(builder.gep(data, [start]), vector.as_pointer())
        values = builder.load(pointer, align=bits // 8)
        undefined = ir.Constant(vector, ir.Undefined)
        lanes = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)

        def splat(x: Any) -> Any:
            first = builder.insert_element(undefined, x, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(first, undefined, lanes)

        moved = builder.sub(builder.and_(values, splat(mask)), splat(low))
        inside = builder.icmp_unsigned("<", moved, splat(wide))
        return builder.bitcast(inside, ir.IntType(64))

    return signature, codegen


word_mask: Any = intrinsic(_word_mask)


def _chunk_masks_py(
    chunk: np.ndarray, keymask: np.ndarray, lo: np.ndarray, width: np.ndarray, masks: np.ndarray
) -> int:
    """Row c of `masks` (64 elements per little-endian word) = the elements of `chunk`
    (at most CHUNK) whose magnitude key lies in [lo[c], lo[c] + width[c]); returns the
    words filled. The block is read from memory once for every class: the classes'
    compares run on data in L1."""
    m = chunk.size
    full = m // 64
    km = keymask[0]
    for c in range(lo.size):
        low = lo[c]
        wide = width[c]
        for w in range(full):
            masks[c, w] = word_mask(chunk, 64 * w, km, low, wide)
        if m > full * 64:
            bits = np.uint64(0)
            for t in range(m - full * 64):
                key = np.uint64(chunk[full * 64 + t] & km)
                bits |= np.uint64(key - np.uint64(low) < np.uint64(wide)) << np.uint64(t)
            masks[c, full] = bits
    return (m + 63) // 64


chunk_masks = _jit(_chunk_masks_py)


def _class_census_py(
    old: np.ndarray,
    changed: np.ndarray,
    keymask: np.ndarray,
    lo: np.ndarray,
    width: np.ndarray,
    masks: np.ndarray,
    members: np.ndarray,
    hits: np.ndarray,
    complement: np.ndarray,
    gap_at: np.ndarray,
    value_at: np.ndarray,
) -> None:
    """The encoder's classification pass: masks[c] = class c's member mask over the block
    (`changed`'s layout), members[c] its member count, hits[c] its changed members, and
    from those the layout `class_events` writes in: complement[c] where class c codes its
    unchanged members (fewer than its changed ones: the same walk, fewer events), gap_at
    and value_at (size classes + 1) where each class's gaps and values start."""
    scratch = np.empty((lo.size, CHUNK // 64), np.uint64)
    for c in range(lo.size):
        members[c] = 0
        hits[c] = 0
    for start in range(0, old.size, CHUNK):
        words = chunk_masks(old[start : start + CHUNK], keymask, lo, width, scratch)
        first = start // 64
        for c in range(lo.size):
            count = 0
            hit = 0
            for w in range(words):
                m = scratch[c, w]
                masks[c, first + w] = m
                count += popcount(m)
                hit += popcount(m & changed[first + w])
            members[c] += count
            hits[c] += hit
    gap_at[0] = 0
    value_at[0] = 0
    for c in range(lo.size):
        complement[c] = 2 * hits[c] > members[c]
        events = members[c] - hits[c] if complement[c] else hits[c]
        gap_at[c + 1] = gap_at[c] + events
        value_at[c + 1] = value_at[c] + hits[c]


def _class_events_py(
    masks: np.ndarray,
    changed: np.ndarray,
    complement: np.ndarray,
    gap_at: np.ndarray,
    gaps: np.ndarray,
    value_at: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    new_values: np.ndarray,
    old_values: np.ndarray,
) -> None:
    """One walk over the block's words for every class: class c's event gaps go to
    gaps[gap_at[c]:] (members since the previous event; its events are its changed
    members, or its unchanged ones where complement[c]), its changes' new and old values to
    new_values / old_values[value_at[c]:], in element order."""
    classes, words = masks.shape
    for c in range(classes):  # a class at a time: its cursors stay in registers
        flip = complement[c]
        last = -1  # rank of the class's previous event, counted from the current word
        j = gap_at[c]
        k = value_at[c]
        for w in range(words):
            m = masks[c, w]
            ch = changed[w]
            own = m & ch
            e = m & ~ch if flip else own
            # Gaps from each event's rank among the word's members: independent popcounts.
            while e:
                rank = popcount(m & ((e & (np.uint64(0) - e)) - np.uint64(1)))
                gaps[j] = rank - last - 1
                last = rank
                j += 1
                e &= e - np.uint64(1)
            last -= popcount(m)
            start = w * 64
            while own:
                i = start + trailing_zeros(own)
                own &= own - np.uint64(1)
                new_values[k] = new[i]
                old_values[k] = old[i]
                k += 1


def _append_bits_py(out: np.ndarray, at: int, src: np.ndarray, count: int) -> int:
    """OR the first `count` bits of `src` (most significant first) into `out` from bit `at`;
    returns at + count. `out` starts zeroed and src's bits past `count` are zero, so whole
    bytes are shifted in."""
    if count <= 0:
        return at
    nbytes = (count + 7) // 8
    shift = at & 7
    base = at >> 3
    if shift == 0:
        for i in range(nbytes):
            out[base + i] |= src[i]
    else:
        last = out.size
        for i in range(nbytes):
            b = np.uint32(src[i])
            out[base + i] |= np.uint8(b >> np.uint32(shift))
            if base + i + 1 < last:
                out[base + i + 1] |= np.uint8((b << np.uint32(8 - shift)) & np.uint32(0xFF))
    return at + count


def _rice_classes_py(
    gaps: np.ndarray, gap_at: np.ndarray, members: np.ndarray, r: np.ndarray, bits: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every class's gaps (class c's at gaps[gap_at[c]:gap_at[c + 1]], counted among its
    members[c] members) Rice-coded, and the classes' codes joined bit to bit, no padding
    between: (low planes, unary codes). r[c] gets class c's Rice parameter (the one
    `rice_parameter` picks, 0 for a class without events), bits[c] its unary bit count.
    One call per block: per-class calls (parameter, pack, then a join) cost more than the
    coding itself on small tensors."""
    classes = gap_at.size - 1
    low_bits = 0
    unary_bits = 0
    for c in range(classes):
        count = gap_at[c + 1] - gap_at[c]
        own = 0
        total = np.int64(count)
        if count:
            own = rice_parameter(gaps[gap_at[c] : gap_at[c + 1]], members[c], 31)
            shift = np.uint64(own)
            for i in range(gap_at[c], gap_at[c + 1]):
                total += np.int64(np.uint64(gaps[i]) >> shift)
        r[c] = own
        bits[c] = total
        low_bits += own * count
        unary_bits += int(total)
    low = np.zeros((low_bits + 7) // 8, np.uint8)
    unary = np.zeros((unary_bits + 7) // 8, np.uint8)
    low_at = 0
    unary_at = 0
    for c in range(classes):
        count = gap_at[c + 1] - gap_at[c]
        if count == 0:
            continue
        planes, codes, total = rice_pack(gaps[gap_at[c] : gap_at[c + 1]], r[c])
        plane = (count + 7) // 8
        for j in range(r[c]):
            low_at = append_bits(low, low_at, planes[j * plane :], count)
        unary_at = append_bits(unary, unary_at, codes, int(total))
    return low, unary


def _rice_classes_decode_py(
    low: np.ndarray,
    unary: np.ndarray,
    unary_end: int,
    r: np.ndarray,
    gap_at: np.ndarray,
    gaps: np.ndarray,
) -> int:
    """Inverse of `rice_classes`: every class's gaps into gaps[gap_at[c]:gap_at[c + 1]]
    (`rice_bits` class after class, each class's low planes right after the previous
    class's). Returns the unary bit after the last code, or -1 if the codes run past
    `unary_end`."""
    low_at = 0
    pos = 0
    for c in range(r.size):
        count = gap_at[c + 1] - gap_at[c]
        if count == 0:
            continue
        pos = rice_bits(low, low_at, unary, pos, unary_end, r[c], gaps[gap_at[c] : gap_at[c + 1]])
        if pos < 0:
            return -1
        low_at += r[c] * count
    return pos


def _class_members_py(
    bits: np.ndarray, keymask: np.ndarray, lo: np.ndarray, width: np.ndarray, counts: np.ndarray
) -> None:
    """counts[c] = elements of `bits` whose magnitude key lies in [lo[c], lo[c] + width[c]),
    every class counted in one read of the block."""
    masks = np.empty((lo.size, CHUNK // 64), np.uint64)
    for c in range(lo.size):
        counts[c] = 0
    for start in range(0, bits.size, CHUNK):
        words = chunk_masks(bits[start : start + CHUNK], keymask, lo, width, masks)
        for c in range(lo.size):
            for w in range(words):
                counts[c] += popcount(masks[c, w])


def _list_bits_py(own: np.ndarray, words: int, out: np.ndarray) -> int:
    """Write the index 64 w + bit of every set bit of own[:words] to `out` (uint16), in
    order; return how many. Four bits per step whatever the word holds (a cleared word
    yields 64s that the next word overwrites), so the loop's exit mispredicts once per four
    bits rather than once per word; `out` needs 64 elements of slack (the vector form's)."""
    at = 0
    for w in range(words):
        m = own[w]
        first = np.uint16(64 * w)
        end = at + popcount(m)
        while m:
            out[at] = first + np.uint16(trailing_zeros(m))
            m &= m - np.uint64(1)
            out[at + 1] = first + np.uint16(trailing_zeros(m))
            m &= m - np.uint64(1)
            out[at + 2] = first + np.uint16(trailing_zeros(m))
            m &= m - np.uint64(1)
            out[at + 3] = first + np.uint16(trailing_zeros(m))
            m &= m - np.uint64(1)
            at += 4
        at = end
    return at


def _compress_word(typingctx: Any, out: Any, at: Any, mask: Any, first: Any) -> Any:
    """Write first + t for every set bit t of the 64-bit `mask`, in order, to the uint16
    array `out` from `at`; return `at` plus their count. Two AVX-512 VBMI2 compresses
    (`vpcompressw`, 32 lanes each, through their LLVM intrinsic) of the lanes' indices,
    each stored whole: no branch and no loop per bit; writes up to 64 elements."""
    if not isinstance(out, types.Array) or out.dtype != types.uint16:
        return None
    signature = types.intp(out, types.intp, types.uint64, types.intp)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        array, start, bits, base = args
        data = context.make_array(sig.args[0])(context, builder, array).data
        i16, i32, i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
        lanes = ir.VectorType(i16, 32)
        flags = ir.VectorType(ir.IntType(1), 32)
        module = builder.module
        name = "llvm.x86.avx512.mask.compress.v32i16"
        compress = module.globals.get(name) or ir.Function(
            module, ir.FunctionType(lanes, [lanes, lanes, flags]), name
        )
        count = module.globals.get("llvm.ctpop.i32") or ir.Function(
            module, ir.FunctionType(i32, [i32]), "llvm.ctpop.i32"
        )
        undefined = ir.Constant(lanes, ir.Undefined)
        first16 = builder.insert_element(undefined, builder.trunc(base, i16), ir.Constant(i32, 0))
        splat = builder.shuffle_vector(
            first16, undefined, ir.Constant(ir.VectorType(i32, 32), [0] * 32)
        )
        at_ = start
        for half in range(2):
            indices = builder.add(ir.Constant(lanes, [32 * half + t for t in range(32)]), splat)
            part = builder.trunc(builder.lshr(bits, ir.Constant(i64, 32 * half)), i32)
            packed = builder.call(compress, [indices, undefined, builder.bitcast(part, flags)])
            pointer = builder.bitcast(builder.gep(data, [at_]), lanes.as_pointer())
            builder.store(packed, pointer, align=2)
            at_ = builder.add(at_, builder.zext(builder.call(count, [part]), at_.type))
        return at_

    return signature, codegen


compress_word: Any = intrinsic(_compress_word)


def _list_bits_vector(own: np.ndarray, words: int, out: np.ndarray) -> int:
    """`_list_bits_py` by two vector compresses per word."""
    at = 0
    for w in range(words):
        at = compress_word(out, at, own[w], 64 * w)
    return at


def _vector_compress() -> bool:
    """Whether this CPU compresses 16-bit lanes (AVX-512 VBMI2)."""
    return bool(_HOST_FEATURES.get("avx512vbmi2")) and bool(_HOST_FEATURES.get("avx512bw"))


VECTOR_COMPRESS = _vector_compress()
list_bits: Any = _jit(_list_bits_vector if VECTOR_COMPRESS else _list_bits_py)


def _apply_classes_py(
    bits: np.ndarray,
    source: np.ndarray,
    fill: bool,
    keymask: np.ndarray,
    lo: np.ndarray,
    width: np.ndarray,
    complement: np.ndarray,
    gaps: np.ndarray,
    gap_at: np.ndarray,
    value_at: np.ndarray,
    mode: int,
    values: np.ndarray,
    down: np.ndarray,
    index: np.ndarray,
    magnitudes: np.ndarray,
    width_bits: int,
    found: np.ndarray,
) -> int:
    """Apply a class-form block in one pass over its elements; OK or an error code.

    Per chunk of CHUNK elements the classes' member masks are built at once
    (`chunk_masks`). Then per class: its events in the chunk are set in a bitmap by rank
    among the class's members (each rank the previous one plus its gap plus one, 64 ranks
    per register) and each word's share of that bitmap is deposited on the word's members
    (`deposit`: pdep, or a select per event where pdep is slow or absent); its changes
    (its events, or its members less them for a complement class) are listed in element
    order (`list_bits`) and take their values in one straight loop: values are stored class
    by class, value_at[c] .. value_at[c + 1] being class c's (mode 0 NEW, 1 XOR:
    `values`; 2 STEP: sign bit j of `down`, and magnitudes[a] + 2 ulps instead of 1 where
    index[a] == j; both end with a sentinel, index's all ones). The union of the chunk's
    changes goes to `found` (exactly the block's count) in element
    order. Checks: every gap lands on a member, every class has exactly its count
    of changes, `found` is filled exactly, every magnitude is used.

    With `fill`, `bits` starts uninitialised and `source` (the same size) holds the block's
    previous state: each chunk is copied from it just before it is classified, so the
    block is read and written once (after a separate copy of a block larger than L2, the
    pass found most of it back in L3 or memory). A failed block is left part filled.
    """
    classes = lo.size
    top = np.uint64(1) << np.uint64(width_bits - 1)
    full = (top << np.uint64(1)) - np.uint64(1)
    per_chunk = CHUNK // 64
    masks = np.empty((classes, per_chunk), np.uint64)
    before = np.empty(per_chunk, np.uint64)  # a class's members before each word
    ranked = np.zeros(per_chunk + 1, np.uint64)  # its events by rank among its members
    events = np.zeros(per_chunk, np.uint64)  # its events in each word
    own = np.zeros(per_chunk, np.uint64)  # its changes in each word
    union = np.zeros(per_chunk, np.uint64)
    at = np.empty(CHUNK + 64, np.uint16)  # its changes' positions in the chunk
    ev = gap_at[:classes].copy()  # each class's next event
    pending = np.zeros(classes, np.uint64)  # members to pass before it
    limit = np.uint64(bits.size)  # no gap is longer: refused, so ranks never wrap
    cursor = value_at[:classes].copy()  # each class's next value
    next_at = np.zeros(classes, np.int64)  # its first magnitude index not yet used
    for c in range(classes):
        if ev[c] < gap_at[c + 1]:
            pending[c] = gaps[ev[c]]
            if pending[c] >= limit:
                return ERR_EVENTS
        start = value_at[c]
        a = 0
        above = index.size - 1
        while a < above:  # first magnitude index >= start
            mid = (a + above) // 2
            if index[mid] < np.uint64(start):
                a = mid + 1
            else:
                above = mid
        next_at[c] = a
    out = 0
    used = 0
    for chunk_start in range(0, bits.size, CHUNK):
        chunk_end = min(chunk_start + CHUNK, bits.size)
        if fill:  # through views indexed from 0: a loop numba vectorises (~9 GB/s)
            into = bits[chunk_start:chunk_end]
            previous = source[chunk_start:chunk_end]
            for i in range(into.size):
                into[i] = previous[i]
        words = chunk_masks(bits[chunk_start:chunk_end], keymask, lo, width, masks)
        for w in range(per_chunk):
            union[w] = 0
        for c in range(classes):
            total = np.uint64(0)
            for w in range(words):
                before[w] = total
                total += np.uint64(popcount(masks[c, w]))
                events[w] = 0
            i = ev[c]
            end = gap_at[c + 1]
            if i < end:
                rank = pending[c]
                if rank < total:
                    # The events as a bitmap over the class's members in the chunk (bit r:
                    # its r-th member), built in a register per 64 members; then each
                    # word's share of it deposited on the word's members (pdep). Per
                    # event: a shift and an or; selects and a word table cost ~8 ns.
                    for q in range(np.int64((total + np.uint64(63)) >> np.uint64(6)) + 1):
                        ranked[q] = 0
                    q = rank >> np.uint64(6)
                    acc = np.uint64(0)
                    while True:
                        acc |= np.uint64(1) << (rank & np.uint64(63))
                        i += 1
                        if i == end:
                            break
                        g = gaps[i]
                        if g >= limit:
                            return ERR_EVENTS
                        rank += g + np.uint64(1)
                        if rank >= total:
                            break
                        if rank >> np.uint64(6) != q:
                            ranked[q] = acc
                            acc = np.uint64(0)
                            q = rank >> np.uint64(6)
                    ranked[q] = acc
                    for w in range(words):
                        first = before[w]
                        at_word = first >> np.uint64(6)
                        off = first & np.uint64(63)
                        # bits first.. of the bitmap; the second shift is split so that an
                        # offset of 0 shifts by 64 in two legal steps
                        x = (ranked[at_word] >> off) | (
                            (ranked[at_word + np.uint64(1)] << np.uint64(1))
                            << (np.uint64(63) - off)
                        )
                        events[w] = deposit(x, masks[c, w])
                ev[c] = i
                pending[c] = rank - total
            if complement[c]:
                for w in range(words):
                    own[w] = masks[c, w] & ~events[w]
            else:
                for w in range(words):
                    own[w] = events[w]
            for w in range(words):
                union[w] |= own[w]
            count = list_bits(own, words, at)
            j = cursor[c]
            if j + count > value_at[c + 1]:
                return ERR_EVENTS
            if mode == 2:
                # The class's next magnitude by its change index (the sentinel past the
                # last never matches), taken without a branch: whether a change has one
                # is close to a coin toss at high density.
                a = next_at[c]
                for q in range(count):
                    pos = chunk_start + np.int64(at[q])
                    hit = np.uint64(index[a] == np.uint64(j))
                    step_ = np.uint64(1) + hit * (np.uint64(magnitudes[a]) + np.uint64(1))
                    a += np.int64(hit)
                    b = np.uint64(bits[pos])
                    key = b ^ full if b & top else b ^ top
                    sub = np.uint64(0) - np.uint64((down[j >> 3] >> (7 - (j & 7))) & 1)
                    key = (key + step_ - ((step_ << np.uint64(1)) & sub)) & full
                    bits[pos] = key ^ top if key & top else key ^ full
                    j += 1
                used += a - next_at[c]
                next_at[c] = a
            elif mode == 1:
                for q in range(count):
                    bits[chunk_start + np.int64(at[q])] ^= values[j + q]
                j += count
            else:
                for q in range(count):
                    bits[chunk_start + np.int64(at[q])] = values[j + q]
                j += count
            cursor[c] = j
        changes = list_bits(union, words, at)
        if out + changes > found.size:
            return ERR_EVENTS
        for q in range(changes):
            found[out + q] = chunk_start + np.int64(at[q])
        out += changes
    for c in range(classes):
        if ev[c] != gap_at[c + 1] or cursor[c] != value_at[c + 1]:
            return ERR_EVENTS
    if out != found.size or used != index.size - 1:
        return ERR_EVENTS
    return OK


def _bits64_py(data: np.ndarray, at: int) -> np.uint64:
    """The 64 bits of `data` (most significant first) from bit `at`, zeros past its end."""
    first = at >> 3
    word = np.uint64(0)
    for t in range(8):
        byte = data[first + t] if first + t < data.size else 0
        word = (word << np.uint64(8)) | np.uint64(byte)
    after = np.uint64(data[first + 8] if first + 8 < data.size else 0)
    skip = np.uint64(at & 7)
    return (word << skip) | (after >> (np.uint64(8) - skip))


bits64 = _jit(_bits64_py)


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
    past `unary_end`. Both streams are read 64 bits at a time from any bit offset: the
    unary codes by a leading-zero count per code, the low bits 64 values per window."""
    k = out.size
    shift = np.uint64(r)
    pos = unary_at
    i = 0
    q = 0  # zeros of the current code before this window
    while i < k:
        if pos >= unary_end:
            return -1
        window = bits64(unary, pos)
        valid = min(64, unary_end - pos)
        if valid < 64:  # bits past the stream's end are not codes
            window &= ~(np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(valid))
        used = 0  # bits of this window consumed
        while window and i < k:
            one = int(leading_zeros(window))
            out[i] = np.uint64(q + one - used) << shift
            i += 1
            q = 0
            used = one + 1
            window ^= np.uint64(1) << np.uint64(63 - one)
        if i == k:
            pos += used
            break
        q += valid - used
        pos += valid
    for j in range(r):
        base = low_at + j * k
        plane = np.uint64(j)
        for first in range(0, k, 64):
            window = bits64(low, base + first)
            for t in range(min(64, k - first)):
                bit = (window >> np.uint64(63 - t)) & np.uint64(1)
                out[first + t] |= bit << plane
    return pos


def _key_counts_py(
    bits: np.ndarray, keymask: int, shift: int, stride: int, counts: np.ndarray
) -> None:
    """counts[b] += 1 for the bin b = (x & keymask) >> shift of every `stride`-th element."""
    km = np.uint64(keymask)
    sh = np.uint64(shift)
    for i in range(0, bits.size, stride):
        counts[(np.uint64(bits[i]) & km) >> sh] += 1


def _changed_key_counts_py(
    old: np.ndarray, changed: np.ndarray, keymask: int, shift: int, counts: np.ndarray
) -> None:
    """counts[b] += 1 for the bin b = (x & keymask) >> shift of every changed element's
    base value x (`changed`: the block's change mask), without gathering them."""
    km = np.uint64(keymask)
    sh = np.uint64(shift)
    for w in range(changed.size):
        m = changed[w]
        start = w * 64
        while m:
            i = start + trailing_zeros(m)
            m &= m - np.uint64(1)
            counts[(np.uint64(old[i]) & km) >> sh] += 1


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
    # Each class's cost (bins j..i-1) once, not once per class count and live count: the
    # logarithms were most of the search. The same expression, so the same bits.
    has = np.zeros((m + 1, m + 1), np.bool_)
    seg = np.zeros((m + 1, m + 1))
    for i in range(1, m + 1):
        for j in range(1, i):
            k = k_sum[i] - k_sum[j]
            if k > 0:
                has[j, i] = True
                seg[j, i] = h2_bits(n_sum[i] - n_sum[j], k) + live_bits
    for c in range(1, max_classes):
        for live in range(max_live + 1):
            for i in range(c + 1, m + 1):
                for j in range(c, i):
                    if has[j, i]:
                        if live == 0:
                            continue
                        prev = best[c - 1, live - 1, j]
                        cost = seg[j, i]
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


def _plan_block_py(
    old: np.ndarray,
    per_bin: np.ndarray,
    keymask: int,
    shift: int,
    stride: int,
    max_classes: int,
    max_live: int,
    live_bits: float,
    class_bits: float,
    starts: np.ndarray,
) -> tuple[int, float, float]:
    """The encoder's choice of classes for one block, in one call: elements per bin from
    every `stride`-th base element (`key_counts`) scaled to the block, each bin holding at
    least its changes (`per_bin`, counted exactly), then `choose_classes`. Returns (classes,
    their estimated bits, the gaps form's n·H2(k/n)); `starts` gets each class's first bin.
    The same arithmetic as the numpy it replaced, so the same choice."""
    bins = per_bin.size
    elements = np.zeros(bins, np.int64)
    key_counts(old, keymask, shift, stride, elements)
    total = 0
    k = 0
    for b in range(bins):
        total += elements[b]
        k += per_bin[b]
    n = float(old.size)
    scale = n / max(1, total)
    estimated = np.empty(bins)
    changes = np.empty(bins)
    for b in range(bins):
        changes[b] = float(per_bin[b])
        estimated[b] = max(elements[b] * scale, changes[b])
    count, bits = choose_classes(
        estimated, changes, max_classes, max_live, live_bits, class_bits, starts
    )
    return count, bits, h2_bits(n, float(k))


class_census = _jit(_class_census_py)
class_events = _jit(_class_events_py)
append_bits = _jit(_append_bits_py)
class_members = _jit(_class_members_py)
apply_classes = _jit(_apply_classes_py)
rice_bits = _jit(_rice_bits_py)
rice_classes = _jit(_rice_classes_py)
rice_classes_decode = _jit(_rice_classes_decode_py)
key_counts = _jit(_key_counts_py)
changed_key_counts = _jit(_changed_key_counts_py)
choose_classes = _jit(_choose_classes_py)
plan_block = _jit(_plan_block_py)
