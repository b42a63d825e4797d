"""The `sparse` codec's newest encoding, `sparse-v3`: positions coded within classes of the base.

Where a real optimizer step changes a float is not uniform: an update of about the learning
rate moves a value only if it exceeds half a unit in its last place, so small-magnitude
elements change often and large ones almost never. The decoder holds the base, so the base
value's magnitude is free context. `sparse-v3` cuts a block's elements into a few classes by
the base's magnitude key (its bits less the sign: exponent, then mantissa) and codes each
class's changes as Rice-coded gaps counted among that class's elements only; a class that
never changes costs one byte, and positions cost about H(changed | class) instead of
sparse-v2's order-0 H(changed) (measured: a third less on real AdamW steps).

The encoder estimates both costs per block from sampled counts and writes the class form
only where it saves bytes; elsewhere the block is a sparse-v2 block behind one form byte, so
the class form's extra work (classifying every element of the block) is paid only where it
pays. Both directions classify a block in one pass and walk it once for all classes.
Values (sign and magnitude, or NEW/XOR planes) are sparse-v2's streams. Kernels:
`store.codecs.class_kernels`. Layout: `docs/format.md` §5b. Never reads or writes anything
but the arrays it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, pairwise

import numpy as np

from store.codecs.bitstreams import (
    read_varint,
    rice_decode,
    write_varint,
)
from store.codecs.class_kernels import (
    OK,
    apply_classes,
    changed_key_counts,
    class_census,
    class_events,
    class_members,
    plan_block,
    rice_classes,
    rice_classes_decode,
)
from store.codecs.sparse import join_planes
from store.codecs.sparse_kernels import change_mask, gather_changes, read_only
from store.codecs.sparse_v2 import (
    _FILL_MIN_BYTES,
    _GAP,
    VALUES_STEP,
    SparseV2Codec,
    _check_unary,
    _ValueHeader,
)
from store.errors import CorruptPayload
from store.tensors import ELEMENT_BITS, RawTensor

TAG = 0x33  # "3"
FORM_GAPS = 0  # a block's first byte: 0 = a sparse-v2 block follows, else its class count
MAX_CLASSES = 12
MAX_LIVE = 5  # classes with changes: each costs the decoder a compare per element and a walk
# Mantissa bits per float dtype: the magnitude key >> this is the biased exponent, the
# coarsest bins the encoder groups into classes. Other dtypes are coded as sparse-v2.
MANTISSA_BITS = {"BF16": 7, "F16": 10, "F32": 23, "F8_E4M3": 3, "F8_E5M2": 2}
_SAMPLE = 1 << 14  # base elements whose exponents the encoder counts per block (strided)
_LIVE_BITS_PER_ELEMENT = 1 / 8192  # a live class's decode work, priced in bits per element
_LIVE_HEADER_BITS = 16.0  # a live class's events, Rice parameter and unary count
_CLASS_BITS = 16.0  # a class's threshold and event count
_RICE_SLACK = 1.03  # Rice codes spend ~3 % over n·H2(k/n) at these densities
_GAIN = 1.02  # try classes unless they are estimated this much larger (then keep the smaller)
_SURE = 0.8  # ... and skip encoding the gaps form when they are estimated this much smaller
_NO_INDEX = np.uint64(np.iinfo(np.uint64).max)  # STEP index sentinel: no change has it
# What `apply_classes` reads where a block has no such stream (it never writes them): made
# once, not per block, as small allocations are a block's fixed cost on small tensors.
# Read-only, as every array the decoders hand a kernel to read (`read_only`).
_NO_STEP_INDEX = read_only(np.full(1, _NO_INDEX, np.uint64))
_NO_MAGNITUDE = read_only(np.zeros(1, np.uint64))
_NO_SIGNS = read_only(np.empty(0, np.uint8))
_NO_VALUES = {width: read_only(np.empty(0, bits)) for width, bits in ELEMENT_BITS.items()}


def _keymask(width: int) -> int:
    return (1 << (8 * width - 1)) - 1


def _class_ranges(starts: list[int], keymask: int) -> list[tuple[int, int]]:
    """(lo, width) of each class's magnitude keys."""
    ends = [*starts[1:], keymask + 1]
    return [(lo, end - lo) for lo, end in zip(starts, ends, strict=True)]


class SparseV3Codec(SparseV2Codec):
    name = "sparse"
    delta_encoding = "sparse-v3"
    tag = TAG

    def _block_encoder(self, target: RawTensor) -> Callable[[np.ndarray, np.ndarray], bytes]:
        shift = MANTISSA_BITS.get(target.dtype)
        if shift is None:
            return self._encode_gaps_form
        return lambda new, old: self._encode_either_form(new, old, shift)

    # -- encoding -------------------------------------------------------------------------

    def _encode_gaps_form(self, new: np.ndarray, old: np.ndarray) -> bytes:
        return bytes((FORM_GAPS,)) + self._encode_block(new, old)

    def _encode_either_form(self, new: np.ndarray, old: np.ndarray, shift: int) -> bytes:
        """The class form where it is estimated, and measured, to be smaller; else gaps."""
        changed = np.empty(-(-new.size // 64), np.uint64)
        k = change_mask(new, old, changed)
        if k == 0:
            return bytes((FORM_GAPS, 0))  # an unchanged block is one count either way
        keymask = _keymask(old.dtype.itemsize)
        per_bin = np.zeros((keymask >> shift) + 1, np.int64)
        changed_key_counts(old, changed, keymask, shift, per_bin)
        plan = self._plan_classes(old, per_bin, shift)
        if plan is None:
            return self._encode_gaps_from(new, old, changed, k)
        starts, ratio = plan
        classes = self._encode_classes(new, old, changed, k, per_bin, starts, shift)
        if ratio > _SURE:  # a close call: encode both and keep the smaller
            gaps_form = self._encode_gaps_from(new, old, changed, k)
            if len(gaps_form) <= len(classes):
                return gaps_form
        return classes

    def _encode_gaps_from(
        self, new: np.ndarray, old: np.ndarray, changed: np.ndarray, k: int
    ) -> bytes:
        """Form 0 from the block's change mask and its count."""
        gaps = np.empty(k, _GAP)
        new_values, old_values = np.empty(k, new.dtype), np.empty(k, old.dtype)
        gather_changes(new, old, changed, gaps, new_values, old_values)
        return bytes((FORM_GAPS,)) + self._encode_changes(new.size, gaps, new_values, old_values)

    def _plan_classes(
        self, old: np.ndarray, per_bin: np.ndarray, shift: int
    ) -> tuple[list[int], float] | None:
        """(the classes' first keys, estimated class bits / gap bits) if classes are
        estimated to save bytes, else None. Elements per exponent come from a strided
        sample of the base, changes per exponent (`per_bin`) from the changed elements
        themselves."""
        n = float(old.size)
        starts = np.zeros(MAX_CLASSES, np.int64)
        count, class_bits, h2 = plan_block(
            old,
            per_bin,
            _keymask(old.dtype.itemsize),
            shift,
            max(1, old.size // _SAMPLE),
            MAX_CLASSES,
            MAX_LIVE,
            _LIVE_HEADER_BITS + _LIVE_BITS_PER_ELEMENT * n,
            _CLASS_BITS,
            starts,
        )
        gaps_bits = _RICE_SLACK * h2
        if count < 2 or _RICE_SLACK * class_bits >= _GAIN * gaps_bits:
            return None
        return [s << shift for s in starts[:count].tolist()], _RICE_SLACK * class_bits / gaps_bits

    def _encode_classes(
        self,
        new: np.ndarray,
        old: np.ndarray,
        changed: np.ndarray,
        k: int,
        per_bin: np.ndarray,
        starts: list[int],
        shift: int,
    ) -> bytes:
        """The class form of a block with `k` changes (`changed`: its change mask).

        Classes without changes (known from `per_bin`, the changes per exponent) cost one
        byte and no work; the others are classified in one pass over the base
        (`class_census`) and walked in one more (`class_events`), which also gathers the
        values class by class: a class's steps are alike (small values move by more ulps),
        so their magnitudes code smaller."""
        keymask = _keymask(new.dtype.itemsize)
        ranges = _class_ranges(starts, keymask)
        # Changes before each bin, once: a numpy call per class cost more than the
        # kernels on small tensors.
        before = [0, *np.cumsum(per_bin).tolist()]
        live = [
            c
            for c, (lo, width) in enumerate(ranges)
            if before[min((lo + width) >> shift, per_bin.size)] > before[lo >> shift]
        ]
        lo = np.array([ranges[c][0] for c in live], new.dtype)
        width = np.array([ranges[c][1] for c in live], new.dtype)
        masks = np.empty((len(live), changed.size), np.uint64)
        # Per live class: members, changed members, Rice parameter, unary bits; the
        # complement flags (code the unchanged members: fewer, same walk); where each
        # class's gaps and values start. Rows of two arrays: fewer allocations per block.
        counts = np.empty((4, len(live)), np.int64)
        members, hits, r, unary_bits_of = counts
        complement = np.empty(len(live), np.bool_)
        at = np.empty((2, len(live) + 1), np.int64)
        gap_at, value_at = at
        class_census(
            old,
            changed,
            np.array([keymask], new.dtype),
            lo,
            width,
            masks,
            members,
            hits,
            complement,
            gap_at,
            value_at,
        )
        gap_ends = gap_at.tolist()
        gaps = np.empty(gap_ends[-1], np.uint32)
        new_values, old_values = np.empty(k, new.dtype), np.empty(k, old.dtype)
        class_events(
            masks, changed, complement, gap_at, gaps, value_at, new, old, new_values, old_values
        )
        head = bytearray((len(starts),))  # the form byte: how many classes
        write_varint(k, head)
        head.append(shift)
        for below, above in pairwise(starts):
            write_varint((above - below) >> shift, head)
        # Every live class's gaps Rice-coded and joined bit to bit, no padding between, in
        # one kernel call.
        low, unary = rice_classes(gaps, gap_at, members, r, unary_bits_of)
        fields = [0] * len(starts)
        # Rice r in the low 5 bits, the complement flag, then the event count; no unary
        # bit count per class: a class's codes end at its events-th one bit.
        for c, below, end, flip, rice in zip(
            live, gap_ends[:-1], gap_ends[1:], complement.tolist(), r.tolist(), strict=True
        ):
            fields[c] = (end - below) << 6 | flip << 5 | rice
        for field in fields:
            write_varint(field, head)
        unary_bits = sum(unary_bits_of.tolist())
        write_varint(unary_bits, head)
        mode, value_fields, value_streams = self._value_part(new_values, old_values)
        head.append(mode)
        head += value_fields
        return self._finish_block(head, [low, unary, *value_streams])

    def _block_changes(self, block: bytes) -> int:
        return read_varint(block, 1, "block")[0]

    # -- decoding -------------------------------------------------------------------------

    def _apply_block(
        self, bits: np.ndarray, block: memoryview, what: str, source: np.ndarray | None = None
    ) -> np.ndarray:
        if len(block) < 2:
            raise CorruptPayload(f"{what} is {len(block)} bytes: no form byte and count")
        if block[0] == FORM_GAPS:
            return super()._apply_block(bits, block[1:], what, source)
        if source is not None and source.nbytes < _FILL_MIN_BYTES:
            np.copyto(bits, source)
            source = None
        # Where the base's classes are read: `bits` once it holds the base, else `source`
        # (a large block: `apply_classes` copies it chunk by chunk as it goes).
        fill = source is not None
        keys = source if source is not None else read_only(bits)
        count = block[0]
        if count > MAX_CLASSES:
            raise CorruptPayload(f"{what} has position form {count}, expected 0-{MAX_CLASSES}")
        changed, offset = read_varint(block, 1, what)
        if not 0 < changed <= bits.size or offset >= len(block):
            raise CorruptPayload(f"{what} claims {changed} changes in {bits.size} elements")
        shift = block[offset]
        offset += 1
        keymask = _keymask(bits.dtype.itemsize)
        if shift >= 8 * bits.dtype.itemsize:
            raise CorruptPayload(f"{what} has class key shift {shift}")
        starts = [0]
        for _ in range(count - 1):
            step, offset = read_varint(block, offset, what)
            lo = starts[-1] + (step << shift)
            if not starts[-1] < lo <= keymask:
                raise CorruptPayload(f"{what} has class thresholds out of order ({lo})")
            starts.append(lo)
        live: list[tuple[int, int, bool]] = []  # (lo, width, complement) of classes with changes
        counts: list[int] = []  # their changes; -1 for a complement class, settled below
        rice: list[int] = []  # their Rice parameters
        gap_at = [0]  # where their gaps start
        low_bits = total_events = unary_bound = 0
        for lo, width in _class_ranges(starts, keymask):
            field, offset = read_varint(block, offset, what)
            events, complement, r = field >> 6, bool(field >> 5 & 1), field & 31
            if events > bits.size:
                raise CorruptPayload(f"{what} claims {events} events in one class")
            low_bits += r * events
            total_events += events
            unary_bound += bits.size >> r
            if events or complement:
                live.append((lo, width, complement))
                counts.append(-1 if complement else events)
                rice.append(r)
                gap_at.append(gap_at[-1] + events)
        unary_bits, offset = read_varint(block, offset, what)
        _check_unary(unary_bits, total_events, unary_bound, what)
        if offset >= len(block):
            raise CorruptPayload(f"{what} is truncated before its value mode")
        mode = block[offset]
        offset, values = self._value_header(
            block, offset + 1, changed, mode, bits.dtype.itemsize, what
        )
        sizes = [-(-low_bits // 8), -(-unary_bits // 8)]
        streams = self._read_streams(block, offset, sizes + values.sizes, what)
        gaps = np.empty(total_events, np.uint64)
        # Every class's gaps in one kernel call, each class's codes right after the last's.
        gap_at_of = np.array(gap_at, np.int64)
        unary_at = rice_classes_decode(
            streams[0], streams[1], unary_bits, np.array(rice, np.int64), gap_at_of, gaps
        )
        if unary_at < 0:
            raise CorruptPayload(f"{what}: its unary stream ends inside a class's codes")
        if unary_at != unary_bits:
            raise CorruptPayload(f"{what}: its unary stream holds more than its classes' codes")
        keymask_of = np.array([keymask], bits.dtype)
        lo_of = np.array([lo for lo, _, _ in live], bits.dtype)
        width_of = np.array([width for _, width, _ in live], bits.dtype)
        self._settle_counts(keys, keymask_of, lo_of, width_of, counts, gap_at, changed, what)
        value_at = np.array([0, *accumulate(counts)], np.int64)  # a list: no numpy round trip
        found = np.empty(changed, np.int64)
        error = self._apply_class_values(
            bits,
            keys,
            fill,
            keymask_of,
            lo_of,
            width_of,
            np.array([c for _, _, c in live], np.bool_),
            gaps,
            gap_at_of,
            value_at,
            values,
            streams[2:],
            found,
            what,
        )
        if error != OK:
            raise CorruptPayload(
                f"{what} places a change past the end of its class, or its classes hold "
                f"other than {changed} changes"
            )
        return found

    def _settle_counts(
        self,
        keys: np.ndarray,
        keymask: np.ndarray,
        lo: np.ndarray,
        width: np.ndarray,
        counts: list[int],
        gap_at: list[int],
        changed: int,
        what: str,
    ) -> None:
        """Fill in a complement class's change count (its members less its events): the
        block's count less the others' where it is the only one, else by counting the
        members of all but the last of them in one more read of the block (`keys`: its
        base's elements)."""
        open_ = [c for c, count in enumerate(counts) if count < 0]
        if len(open_) > 1:
            counted = open_[:-1]
            members = np.empty(len(counted), np.int64)
            class_members(keys, keymask, lo[counted], width[counted], members)
            for c, count in zip(counted, members.tolist(), strict=True):
                counts[c] = count - (gap_at[c + 1] - gap_at[c])
        if open_:
            last = open_[-1]
            counts[last] = 0
            counts[last] = changed - sum(counts)
        if not counts or min(counts) < 0 or sum(counts) != changed:
            raise CorruptPayload(f"{what} declares {changed} changes but its classes hold others")

    def _apply_class_values(
        self,
        bits: np.ndarray,
        source: np.ndarray,
        fill: bool,
        keymask: np.ndarray,
        lo: np.ndarray,
        widths: np.ndarray,
        complement: np.ndarray,
        gaps: np.ndarray,
        gap_at: np.ndarray,
        value_at: np.ndarray,
        header: _ValueHeader,
        streams: list[np.ndarray],
        found: np.ndarray,
        what: str,
    ) -> int:
        """Place every class's changes and patch their values (stored class by class, each
        class's in element order) in one pass (`apply_classes`); with `fill` (a large
        block) that pass first copies each chunk of `source`, the base, into `bits`, which
        otherwise holds the base already. Its error code."""
        width = bits.dtype.itemsize
        values = _NO_VALUES[width]
        down = _NO_SIGNS
        # Each with one sentinel past its end (an index no change has), so the kernel
        # reads the next magnitude without a bounds test.
        no_index = _NO_INDEX
        index = _NO_STEP_INDEX
        magnitude = _NO_MAGNITUDE
        if header.mode != VALUES_STEP:
            values = read_only(join_planes(streams, width))
        else:
            down = streams[0]
            if header.nonzero:
                at = rice_decode(
                    streams[1], streams[2], header.gap_bits, header.nonzero, header.r_gap, what
                )
                decoded = rice_decode(
                    streams[3], streams[4], header.value_bits, header.nonzero, header.r_value, what
                )
                if int(at.max()) >= found.size:
                    raise CorruptPayload(f"{what} places a magnitude past its last change")
                index = np.empty(header.nonzero + 1, np.uint64)
                np.cumsum(at + np.uint64(1), out=index[:-1])
                index[:-1] -= np.uint64(1)
                index[-1] = no_index
                index = read_only(index)
                magnitude = read_only(np.concatenate((decoded, magnitude)))
        return int(
            apply_classes(
                bits,
                source,
                fill,
                keymask,
                lo,
                widths,
                complement,
                gaps,
                gap_at,
                value_at,
                header.mode,
                values,
                down,
                index,
                magnitude,
                8 * width,
                found,
            )
        )
