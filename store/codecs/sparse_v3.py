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
the slower apply (one SIMD mask pass per class with changes) is paid only where it pays.
Values (sign and magnitude, or NEW/XOR planes) are sparse-v2's streams. Kernels:
`store.codecs.class_kernels`. Layout: `docs/format.md` §5b. Never reads or writes anything
but the arrays it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import numpy as np

from store.codecs.bitstreams import (
    read_varint,
    rice_decode,
    rice_encode,
    rice_parameter,
    write_varint,
)
from store.codecs.class_kernels import (
    OK,
    apply_class_patches,
    apply_class_steps,
    changed_mask,
    choose_classes,
    class_mask,
    decode_events,
    encode_events,
    h2_bits,
    key_counts,
    positions,
    rice_bits,
)
from store.codecs.sparse import join_planes
from store.codecs.sparse_kernels import gather_changes
from store.codecs.sparse_v2 import (
    VALUES_STEP,
    VALUES_XOR,
    SparseV2Codec,
    _changes,
    _check_unary,
    _ValueHeader,
)
from store.errors import CorruptPayload
from store.tensors import RawTensor

TAG = 0x33  # "3"
FORM_GAPS = 0  # a block's first byte: 0 = a sparse-v2 block follows, else its class count
MAX_CLASSES = 12
MAX_LIVE = 5  # classes with changes: each costs the decoder one mask pass over the block
# Mantissa bits per float dtype: the magnitude key >> this is the biased exponent, the
# coarsest bins the encoder groups into classes. Other dtypes are coded as sparse-v2.
MANTISSA_BITS = {"BF16": 7, "F16": 10, "F32": 23, "F8_E4M3": 3, "F8_E5M2": 2}
_SAMPLE = 1 << 14  # base elements whose exponents the encoder counts per block (strided)
_LIVE_BITS_PER_ELEMENT = 1 / 8192  # a live class's mask pass, priced in bits per element
_LIVE_HEADER_BITS = 16.0  # a live class's events, Rice parameter and unary count
_CLASS_BITS = 16.0  # a class's threshold and event count
_RICE_SLACK = 1.03  # Rice codes spend ~3 % over n·H2(k/n) at these densities
_GAIN = 1.02  # try classes unless they are estimated this much larger (then keep the smaller)
_SURE = 0.8  # ... and skip encoding the gaps form when they are estimated this much smaller


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
        changes = _changes(new, old)
        plan = self._plan_classes(old, changes[2], shift)
        if plan is None:
            return bytes((FORM_GAPS,)) + self._encode_changes(new.size, *changes)
        starts, ratio = plan
        classes = self._encode_classes(new, old, starts, shift)
        if ratio > _SURE:  # a close call: encode both and keep the smaller
            gaps_form = bytes((FORM_GAPS,)) + self._encode_changes(new.size, *changes)
            if len(gaps_form) <= len(classes):
                return gaps_form
        return classes

    def _plan_classes(
        self, old: np.ndarray, old_values: np.ndarray, shift: int
    ) -> tuple[list[int], float] | None:
        """(the classes' first keys, estimated class bits / gap bits) if classes are
        estimated to save bytes, else None. Elements per exponent come from a strided
        sample of the base, changes per exponent from the changed elements themselves."""
        if not old_values.size:
            return None
        keymask = _keymask(old.dtype.itemsize)
        bins = (keymask >> shift) + 1
        elements = np.zeros(bins, np.int64)
        changes = np.zeros(bins, np.int64)
        key_counts(old, keymask, shift, max(1, old.size // _SAMPLE), elements)
        key_counts(old_values, keymask, shift, 1, changes)
        n, k = float(old.size), float(old_values.size)
        # Scaled to the block; a bin holds at least its changes.
        estimated = np.maximum(elements * (n / max(1, int(elements.sum()))), changes)
        gaps_bits = _RICE_SLACK * h2_bits(n, k)
        starts = np.zeros(MAX_CLASSES, np.int64)
        count, class_bits = choose_classes(
            estimated,
            changes.astype(np.float64),
            MAX_CLASSES,
            MAX_LIVE,
            _LIVE_HEADER_BITS + _LIVE_BITS_PER_ELEMENT * n,
            _CLASS_BITS,
            starts,
        )
        if count < 2 or _RICE_SLACK * class_bits >= _GAIN * gaps_bits:
            return None
        return [int(s) << shift for s in starts[:count]], _RICE_SLACK * class_bits / gaps_bits

    def _encode_classes(
        self, new: np.ndarray, old: np.ndarray, starts: list[int], shift: int
    ) -> bytes:
        keymask = _keymask(new.dtype.itemsize)
        words = -(-new.size // 64)
        changed = np.empty(words, np.uint64)
        changed_mask(new, old, changed)
        k = _count(changed)
        if k == 0:
            return bytes((FORM_GAPS, 0))  # an unchanged block is one count either way
        new_values, old_values = np.empty(k, new.dtype), np.empty(k, old.dtype)
        gather_changes(new, old, changed, np.empty(k, np.uint32), new_values, old_values)
        # Changes per class from the changed elements alone: classes without any cost one
        # byte and no pass over the block. Values are stored class by class: a class's
        # steps are alike (small values move by more ulps), so their magnitudes code smaller.
        by_class_new: list[np.ndarray] = []
        by_class_old: list[np.ndarray] = []
        keys = (old_values & old_values.dtype.type(keymask)).astype(np.int64)
        hits = np.bincount(np.searchsorted(starts, keys, side="right") - 1, minlength=len(starts))
        mask = np.empty(words, np.uint64)
        head = bytearray((len(starts),))  # the form byte: how many classes
        write_varint(k, head)
        head.append(shift)
        for below, lo in pairwise(starts):
            write_varint((lo - below) >> shift, head)
        lows: list[np.ndarray] = []  # each class's low bits and unary bits, unpadded
        unaries: list[np.ndarray] = []
        for (lo, width), hit in zip(_class_ranges(starts, keymask), hits.tolist(), strict=True):
            if not hit:
                head.append(0)
                continue
            class_mask(old, keymask, lo, width, mask)
            class_new, class_old = np.empty(hit, new.dtype), np.empty(hit, old.dtype)
            gather_changes(new, old, changed & mask, np.empty(hit, np.uint32), class_new, class_old)
            by_class_new.append(class_new)
            by_class_old.append(class_old)
            members = _count(mask)
            complement = 2 * hit > members  # code the unchanged ones: fewer, same walk
            events = members - hit if complement else hit
            r = 0
            if events:
                values = np.empty(events, np.uint32)
                encode_events(mask, changed, complement, values)
                r = rice_parameter(values, members)
                low, unary, unary_bits = rice_encode(values, r)
                plane = low.reshape(r, -1) if r else low.reshape(0, 1)
                lows += [np.unpackbits(row)[:events] for row in plane]
                unaries.append(np.unpackbits(unary)[:unary_bits])
            # Rice r in the low 5 bits, the complement flag, then the event count; no unary
            # bit count per class: a class's codes end at its events-th one bit.
            write_varint(events << 6 | int(complement) << 5 | r, head)
        write_varint(sum(u.size for u in unaries), head)
        mode, fields, value_streams = self._value_part(
            np.concatenate(by_class_new), np.concatenate(by_class_old)
        )
        head.append(mode)
        head += fields
        joined = [
            np.packbits(np.concatenate([np.empty(0, np.uint8), *part])) for part in (lows, unaries)
        ]
        return self._finish_block(head, [*joined, *value_streams])

    def _block_changes(self, block: bytes) -> int:
        return read_varint(block, 1, "block")[0]

    # -- decoding -------------------------------------------------------------------------

    def _apply_block(self, bits: np.ndarray, block: memoryview, what: str) -> np.ndarray:
        if len(block) < 2:
            raise CorruptPayload(f"{what} is {len(block)} bytes: no form byte and count")
        if block[0] == FORM_GAPS:
            return super()._apply_block(bits, block[1:], what)
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
        classes = []  # (lo, width, events, complement, r)
        low_bits = total_events = unary_bound = 0
        for lo, width in _class_ranges(starts, keymask):
            field, offset = read_varint(block, offset, what)
            events, complement, r = field >> 6, bool(field >> 5 & 1), field & 31
            if events > bits.size:
                raise CorruptPayload(f"{what} claims {events} events in one class")
            low_bits += r * events
            total_events += events
            unary_bound += bits.size >> r
            classes.append((lo, width, events, complement, r))
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
        words = -(-bits.size // 64)
        changed_words = np.zeros(words, np.uint64)
        mask = np.empty(words, np.uint64)
        per_class: list[np.ndarray] = []  # each class's changes, as bits
        low_at = unary_at = 0
        for lo, width, events, complement, r in classes:
            if not events and not complement:
                continue
            class_mask(bits, keymask, lo, width, mask)
            gaps = np.empty(events, np.uint64)
            if events:
                unary_at = rice_bits(streams[0], low_at, streams[1], unary_at, unary_bits, r, gaps)
                if unary_at < 0:
                    raise CorruptPayload(f"{what}: its unary stream ends inside a class's codes")
                low_at += r * events
            own = np.zeros(words, np.uint64)
            if decode_events(mask, gaps, complement, own) != OK:
                raise CorruptPayload(f"{what} places a change past the end of its class")
            per_class.append(own)
            changed_words |= own
        if unary_at != unary_bits:
            raise CorruptPayload(f"{what}: its unary stream holds more than its classes' codes")
        found = np.empty(changed, np.int64)
        if positions(changed_words, found) != changed:
            raise CorruptPayload(f"{what} declares {changed} changes but its classes hold others")
        self._apply_class_values(bits, per_class, changed, values, streams[2:], what)
        return found

    def _apply_class_values(
        self,
        bits: np.ndarray,
        per_class: list[np.ndarray],
        changed: int,
        header: _ValueHeader,
        streams: list[np.ndarray],
        what: str,
    ) -> None:
        """Patch the changes, whose values come class by class (each class's in element
        order), one class at a time."""
        width = bits.dtype.itemsize
        if header.mode != VALUES_STEP:
            values = join_planes(streams, width)
            apply_class_patches(bits, np.stack(per_class), values, header.mode == VALUES_XOR)
            return
        index = magnitude = np.empty(0, np.uint64)
        if header.nonzero:
            at = rice_decode(
                streams[1], streams[2], header.gap_bits, header.nonzero, header.r_gap, what
            )
            magnitude = rice_decode(
                streams[3], streams[4], header.value_bits, header.nonzero, header.r_value, what
            )
            if int(at.max()) >= changed:
                raise CorruptPayload(f"{what} places a magnitude past its last change")
            index = np.cumsum(at + np.uint64(1)) - np.uint64(1)
        if apply_class_steps(bits, np.stack(per_class), streams[0], index, magnitude, 8 * width):
            raise CorruptPayload(f"{what} places a magnitude past its last change")


def _count(words: np.ndarray) -> int:
    """Set bits in an array of uint64 words."""
    return int(np.bitwise_count(words).sum())
