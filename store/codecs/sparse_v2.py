"""The `sparse` codec's current encoding, `sparse-v2`: changed elements coded near their entropy.

At RL learning rates 0.1–3 % of BF16 values move, nearly all by one unit in the last place.
What costs bytes is then *where* they changed: `sparse-v1` stored gaps as zstd'd byte planes
(a nearly uniform low byte plus frame and table overhead per plane and tensor), about 4–5
bits per change above the entropy on a real model. `sparse-v2` Rice-codes the gaps (the
optimal prefix code family for geometric gaps, within a few hundredths of a bit of their
entropy) and stores a STEP value as a sign bit plus a magnitude whose planes are empty for
one-ulp moves. Every stream is stored raw, as a zstd frame, or as "all zero", whichever is
smallest, so clustered changes (long zero runs in the unary stream) still compress.

A tensor is cut into blocks of 2**22 elements, coded independently, so encode and apply run
over blocks in parallel (`store.codecs.workers`). The per-element loops (finding changes,
steps, Rice packing and unpacking, applying steps) are compiled kernels
(`store.codecs.sparse_kernels`) that release the GIL; this module lays out the streams.
Elements are compared as unsigned integers of their width, so NaN payloads and -0.0
round-trip bit for bit. `docs/format.md` §5 gives the byte layout. Never reads or writes
anything but the arrays it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from store.checksum import BlocksInOrder, Digest
from store.codecs.bitstreams import (
    read_varint,
    rice_decode,
    rice_encode,
    rice_parameter,
    write_varint,
)
from store.codecs.sparse import byte_planes, join_planes
from store.codecs.sparse_kernels import (
    ERR_MAGNITUDE,
    ERR_UNARY,
    OK,
    change_mask,
    gather_changes,
    mode_bits,
    nonzero_runs,
    read_only,
    rice_apply_steps,
    split_steps,
)
from store.codecs.workers import map_blocks
from store.codecs.zstd_frames import ZstdContexts, decompress_exact
from store.errors import CorruptPayload
from store.tensors import ELEMENT_BITS, RawTensor

TAG = 0x32  # first byte of every payload ("2"): one byte, not four, as tiny tensors pay it
BLOCK_LOG2 = 22  # 4 Mi elements: 8 MiB of BF16, a unit of parallel work
VALUES_NEW, VALUES_XOR, VALUES_STEP = 0, 1, 2
STREAM_RAW, STREAM_ZSTD, STREAM_ZERO = 0, 1, 2
ZSTD_LEVEL = 1
# The streams zstd gets are byte planes of changed values: near-random bytes whose gain is
# zstd's entropy stage, with few repeats longer than a handful of bytes. Level 1 looks for
# matches from 5 or 6 bytes (by the input's size); from 7 it keeps the ones that pay, spends
# ~30 % less time on these planes, and the update-rule cases of `bench/codec.py` come out
# 0.2-1.5 % smaller (uniform densities: the same bytes). Decoders are unaffected.
ZSTD_MIN_MATCH = 7
_MODE_SAMPLE = 1 << 12  # changed elements inspected to pick a block's value representation
_MAX_UNARY_PER_VALUE = 64  # bound on a STEP block's magnitude unary bits per nonzero magnitude
_GAP = np.dtype("<u4")  # gaps inside a block (blocks hold at most 2**31 elements)
# Blocks at least this large are filled from their source by the STEP walk itself; smaller
# ones are copied first (memcpy), then patched. After a copy a small block is still in
# cache for the walk, and memcpy beats the walk's copy loop: filling every block made the
# bench's 31.6 M-parameter fold ~5 % slower, filling only blocks from 4 MiB left it
# unchanged and made a 0.3 B one (8 MiB blocks) 5-20 % faster (0.1-1 % density).
_FILL_MIN_BYTES = 4 << 20


def _step_parts(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sign, magnitude) of order(new) - order(old), a nonzero wrapped difference.

    sign = 1 for a move down; magnitude = |difference| - 1, so a one-ulp move is 0.
    """
    down = np.empty(new.size, dtype=bool)
    magnitude = np.empty_like(new)
    split_steps(new, old, 8 * new.dtype.itemsize, down, magnitude)
    return down, magnitude


def _changes(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gaps before each changed element, their new bits, their old bits) of one block."""
    words = np.empty(-(-new.size // 64), dtype=np.uint64)
    k = change_mask(new, old, words)
    gaps = np.empty(k, dtype=_GAP)
    news, olds = np.empty(k, dtype=new.dtype), np.empty(k, dtype=old.dtype)
    if k:
        gather_changes(new, old, words, gaps, news, olds)
    return gaps, news, olds


def _choose_mode(new: np.ndarray, old: np.ndarray) -> int:
    """The value representation with the fewest estimated bits on a sample (STEP wins ties)."""
    estimates = np.empty(3)
    mode_bits(new[:_MODE_SAMPLE], old[:_MODE_SAMPLE], 8 * new.dtype.itemsize, estimates)
    by_mode = {VALUES_STEP: estimates[2], VALUES_XOR: estimates[1], VALUES_NEW: estimates[0]}
    return min(by_mode, key=by_mode.__getitem__)


def _check_unary(bits: int, count: int, slack: int, what: str) -> None:
    """A unary stream of `count` codes has at least `count` bits and, by construction of
    the encoder, at most `count + slack`; refusing more bounds a hostile payload's memory."""
    if not count <= bits <= count + slack:
        raise CorruptPayload(f"{what} declares {bits} unary bits for {count} values")


@dataclass(frozen=True)
class _ValueHeader:
    """What a block's value fields declare: the mode, STEP's nonzero magnitudes and their
    Rice parameters and unary bit counts, and the decoded sizes of the value streams."""

    mode: int
    nonzero: int
    r_gap: int
    gap_bits: int
    r_value: int
    value_bits: int
    sizes: list[int]


class SparseV2Codec:
    name = "sparse"
    delta_encoding = "sparse-v2"
    tag = TAG  # the payload's first byte; later encodings built on this one change it

    def __init__(self, level: int = ZSTD_LEVEL, block_log2: int = BLOCK_LOG2) -> None:
        self._zstd = ZstdContexts(level, ZSTD_MIN_MATCH)
        self._block_log2 = block_log2

    # -- encoding -------------------------------------------------------------------------

    def _squeeze(self, raw: np.ndarray) -> tuple[int, bytes | memoryview]:
        """(kind, bytes) of one stream: all zero, a zstd frame, or raw, whichever is smallest."""
        if not np.count_nonzero(raw):  # not `raw.any()`: 5x its cost on a small stream
            return STREAM_ZERO, b""
        if raw.size >= 32:
            frame = self._zstd.compressor.compress(raw.data)
            if len(frame) < raw.size:
                return STREAM_ZSTD, frame
        return STREAM_RAW, raw.data  # joined into the block without a copy of its own

    def _step_streams(
        self, new_values: np.ndarray, old_values: np.ndarray, head: bytearray
    ) -> list[np.ndarray] | None:
        """STEP streams (signs, then nonzero magnitudes' Rice-coded positions and values),
        their header fields appended to `head`; None if the magnitudes are too wild."""
        sign, magnitude = _step_parts(new_values, old_values)
        gaps, values, total = nonzero_runs(magnitude)
        streams = [np.packbits(sign)]
        fields = bytearray()
        write_varint(int(gaps.size), fields)
        if gaps.size:
            r_gap = rice_parameter(gaps, int(magnitude.size))
            r_value = rice_parameter(values, int(total), 62)
            bound = _MAX_UNARY_PER_VALUE * int(gaps.size)
            if int((values >> np.uint64(r_value)).sum()) > bound:
                return None
            gap_low, gap_unary, gap_bits = rice_encode(gaps, r_gap)
            value_low, value_unary, value_bits = rice_encode(values, r_value)
            fields.append(r_gap)
            write_varint(gap_bits, fields)
            fields.append(r_value)
            write_varint(value_bits, fields)
            streams += [gap_low, gap_unary, value_low, value_unary]
        head += fields
        return streams

    def _encode_block(self, new: np.ndarray, old: np.ndarray) -> bytes:
        return self._encode_changes(new.size, *_changes(new, old))

    def _encode_changes(
        self, size: int, gaps: np.ndarray, new_values: np.ndarray, old_values: np.ndarray
    ) -> bytes:
        """A block of `size` elements from its changes (`_changes`)."""
        changed = int(gaps.size)
        head = bytearray()
        write_varint(changed, head)
        if changed == 0:
            return bytes(head)
        r = rice_parameter(gaps, size)
        low, unary, unary_bits = rice_encode(gaps, r)
        mode, fields, value_streams = self._value_part(new_values, old_values)
        head += bytes((mode, r))
        write_varint(unary_bits, head)
        head += fields
        return self._finish_block(head, [low, unary, *value_streams])

    def _value_part(
        self, new_values: np.ndarray, old_values: np.ndarray
    ) -> tuple[int, bytes, list[np.ndarray]]:
        """(mode, its header fields, its streams) of the changed elements' values."""
        mode = _choose_mode(new_values, old_values)
        fields = bytearray()
        value_streams = None
        if mode == VALUES_STEP:
            value_streams = self._step_streams(new_values, old_values, fields)
            mode = VALUES_STEP if value_streams is not None else VALUES_XOR
        if value_streams is None:
            values = new_values ^ old_values if mode == VALUES_XOR else new_values
            value_streams = byte_planes(values, values.dtype.itemsize)
        return mode, bytes(fields), value_streams

    def _finish_block(self, head: bytearray, streams: list[np.ndarray]) -> bytes:
        """`head`, the streams' kinds and zstd lengths, then the (squeezed) streams."""
        squeezed = [self._squeeze(stream) for stream in streams]
        # Stream kinds, 2 bits each, four to a byte; then the stored length of each zstd
        # stream (a raw stream's length is its decoded size, which the reader knows).
        kinds = bytearray(-(-len(squeezed) // 4))
        for j, (kind, _) in enumerate(squeezed):
            kinds[j // 4] |= kind << (2 * (j % 4))
        head += kinds
        for kind, body in squeezed:
            if kind == STREAM_ZSTD:
                write_varint(len(body), head)
        return b"".join([bytes(head), *(body for _, body in squeezed)])

    def encode_tensor(self, target: RawTensor, base: RawTensor) -> np.ndarray | None:
        new, old = target.bits(), base.bits()
        size = 1 << self._block_log2
        starts = range(0, new.size, size)
        encode_block = self._block_encoder(target)
        blocks = map_blocks(lambda s: encode_block(new[s : s + size], old[s : s + size]), starts)
        changed = sum(self._block_changes(b) for b in blocks)
        if changed == 0:
            return None
        head = bytearray((self.tag, target.itemsize, self._block_log2))
        write_varint(int(new.size), head)
        write_varint(changed, head)
        for block in blocks[:-1]:  # the last block takes the rest of the payload
            write_varint(len(block), head)
        return np.frombuffer(b"".join([bytes(head), *blocks]), dtype=np.uint8)

    def _block_encoder(self, target: RawTensor) -> Callable[[np.ndarray, np.ndarray], bytes]:
        """How this encoding codes one block of `target` (new bits, old bits) -> bytes."""
        return self._encode_block

    def _block_changes(self, block: bytes) -> int:
        """The changed-element count an encoded block starts with."""
        return read_varint(block, 0, "block")[0]

    # -- decoding -------------------------------------------------------------------------

    def _stream(self, kind: int, body: memoryview, size: int, what: str) -> np.ndarray:
        if kind == STREAM_ZERO:
            if len(body):
                raise CorruptPayload(f"{what} is marked all-zero but holds {len(body)} bytes")
            return np.zeros(size, dtype=np.uint8)
        if kind == STREAM_ZSTD:
            data = decompress_exact(self._zstd.decompressor, body, size, what)
            return np.frombuffer(data, dtype=np.uint8)
        if kind != STREAM_RAW or len(body) != size:
            raise CorruptPayload(
                f"{what} is {len(body)} bytes of kind {kind}, expected {size} raw bytes"
            )
        return np.frombuffer(body, dtype=np.uint8)

    def _read_streams(
        self, block: memoryview, offset: int, sizes: list[int], what: str
    ) -> list[np.ndarray]:
        """The streams of a block whose descriptors start at `offset`, decoded and checked."""
        count = len(sizes)
        end = offset + -(-count // 4)
        packed = int.from_bytes(block[offset:end], "little")
        if end > len(block) or packed >> 2 * count:
            raise CorruptPayload(f"{what} has a truncated or invalid stream kinds field")
        offset = end
        kinds, lengths = [], []
        for size in sizes:
            kind = packed & 3
            packed >>= 2
            if kind == STREAM_ZSTD:
                length, offset = read_varint(block, offset, what)
            else:
                length = size if kind == STREAM_RAW else 0
            kinds.append(kind)
            lengths.append(length)
        if offset + sum(lengths) != len(block):
            raise CorruptPayload(f"{what} is {len(block)} bytes, its stream table disagrees")
        streams = []
        for j, (kind, length, size) in enumerate(zip(kinds, lengths, sizes, strict=True)):
            if kind == STREAM_RAW:  # most streams: whole (the total checked above), as is
                stream = np.frombuffer(block[offset : offset + length], dtype=np.uint8)
            else:
                body = block[offset : offset + length]
                stream = self._stream(kind, body, size, f"{what} stream {j}")
            streams.append(read_only(stream))  # one type for the kernels, raw or not
            offset += length
        return streams

    def _apply_block(
        self, bits: np.ndarray, block: memoryview, what: str, source: np.ndarray | None = None
    ) -> np.ndarray:
        """Patch `bits` (one block of the tensor, as unsigned ints) in place; return the
        block-relative positions it changed (sorted int64). With `source`, `bits` starts
        uninitialised and `source` holds the block's previous state (see `apply_into`)."""
        if source is not None and source.nbytes < _FILL_MIN_BYTES:
            np.copyto(bits, source)
            source = None
        changed, offset = read_varint(block, 0, what)
        if changed == 0:
            if offset != len(block):
                raise CorruptPayload(f"{what} has no changes but {len(block)} bytes")
            if source is not None:
                np.copyto(bits, source)
            return np.empty(0, dtype=np.int64)
        if changed > bits.size or offset + 2 > len(block):
            raise CorruptPayload(f"{what} claims {changed} changes in {bits.size} elements")
        mode, r = block[offset], block[offset + 1]
        if mode not in (VALUES_NEW, VALUES_XOR, VALUES_STEP) or r > 31:
            raise CorruptPayload(f"{what} has value mode {mode} and Rice parameter {r}")
        unary_bits, offset = read_varint(block, offset + 2, what)
        _check_unary(unary_bits, changed, bits.size >> r, what)
        plane = -(-changed // 8)
        sizes = [r * plane, -(-unary_bits // 8)]
        offset, values = self._value_header(block, offset, changed, mode, bits.dtype.itemsize, what)
        streams = self._read_streams(block, offset, sizes + values.sizes, what)
        if mode == VALUES_STEP:
            return self._apply_steps(bits, streams, unary_bits, changed, r, values, what, source)
        gaps = rice_decode(streams[0], streams[1], unary_bits, changed, r, what)
        if source is not None:  # NEW / XOR blocks are rare (wild values): copy, then patch
            np.copyto(bits, source)
        return self._apply_values(bits, gaps, values, streams[2:], what)

    def _value_header(
        self, block: memoryview, offset: int, changed: int, mode: int, width: int, what: str
    ) -> tuple[int, _ValueHeader]:
        """The value fields of a block's header from `offset` (after the positions' fields):
        the offset after them and what they declare."""
        plane = -(-changed // 8)
        sizes: list[int] = []
        nonzero = r_gap = gap_bits = r_value = value_bits = 0
        if mode == VALUES_STEP:
            nonzero, offset = read_varint(block, offset, what)
            sizes.append(plane)
            if nonzero:
                if nonzero > changed or offset + 1 >= len(block):
                    raise CorruptPayload(f"{what} claims {nonzero} magnitudes of {changed}")
                r_gap = block[offset]
                gap_bits, offset = read_varint(block, offset + 1, what)
                if r_gap > 31 or offset >= len(block):
                    raise CorruptPayload(f"{what} has Rice parameter {r_gap} for magnitudes")
                r_value = block[offset]
                value_bits, offset = read_varint(block, offset + 1, what)
                if r_value > 62:
                    raise CorruptPayload(f"{what} has Rice parameter {r_value} for magnitudes")
                _check_unary(gap_bits, nonzero, changed >> r_gap, what)
                _check_unary(value_bits, nonzero, _MAX_UNARY_PER_VALUE * nonzero, what)
                inner = -(-nonzero // 8)
                sizes += [r_gap * inner, -(-gap_bits // 8), r_value * inner, -(-value_bits // 8)]
        else:
            sizes += [changed] * width
        return offset, _ValueHeader(mode, nonzero, r_gap, gap_bits, r_value, value_bits, sizes)

    def _apply_steps(
        self,
        bits: np.ndarray,
        streams: list[np.ndarray],
        unary_bits: int,
        changed: int,
        r: int,
        header: _ValueHeader,
        what: str,
        source: np.ndarray | None = None,
    ) -> np.ndarray:
        """Patch a STEP block from its streams (the gaps' low planes and unary codes, then
        the STEP streams); return the block-relative positions it changed (sorted int64).

        The gaps are decoded by the same compiled pass that applies the steps
        (`rice_apply_steps`): no array of gaps between the two. With `source`, that pass
        also copies the block from it, chunk by chunk ahead of the steps.
        """
        low, unary = streams[0], streams[1]
        if unary.size * 8 < unary_bits or low.size < r * (-(-changed // 8)):
            raise CorruptPayload(f"{what}: its Rice streams are shorter than {changed} values need")
        at = magnitude = np.empty(0, dtype=np.uint64)
        if header.nonzero:
            at = rice_decode(
                streams[3], streams[4], header.gap_bits, header.nonzero, header.r_gap, what
            )
            magnitude = rice_decode(
                streams[5], streams[6], header.value_bits, header.nonzero, header.r_value, what
            )
        positions = np.empty(changed, dtype=np.uint64)
        width = 8 * bits.dtype.itemsize
        error = rice_apply_steps(
            bits,
            read_only(bits) if source is None else source,
            source is not None,
            low,
            unary,
            unary_bits,
            r,
            streams[2],
            at,
            magnitude,
            width,
            positions,
        )
        if error == ERR_UNARY:
            raise CorruptPayload(
                f"{what}: its unary stream does not hold {changed} codes ending at its last "
                f"bit ({unary_bits} bits)"
            )
        if error == ERR_MAGNITUDE:
            raise CorruptPayload(f"{what} places a magnitude past its last change")
        if error != OK:
            raise CorruptPayload(f"{what} places a change past the end of its block")
        # The kernel wrote each position as the bit pattern of an int64.
        step_positions: np.ndarray = positions.view(np.int64)
        return step_positions

    def _apply_values(
        self,
        bits: np.ndarray,
        gaps: np.ndarray,
        header: _ValueHeader,
        streams: list[np.ndarray],
        what: str,
    ) -> np.ndarray:
        """Patch the changes at `gaps` with the NEW or XOR value `streams` the header
        describes; return their block-relative positions (sorted int64)."""
        mode = header.mode
        if int(gaps.max()) >= bits.size:
            raise CorruptPayload(f"{what} places a change past the end of its block")
        positions = np.cumsum(gaps.view(np.int64) + 1) - 1
        if int(positions[-1]) >= bits.size:
            raise CorruptPayload(f"{what} places a change past the end of its block")
        if mode == VALUES_XOR:
            bits[positions] ^= join_planes(streams, bits.dtype.itemsize)
        else:
            bits[positions] = join_planes(streams, bits.dtype.itemsize)
        block_positions: np.ndarray = positions
        return block_positions

    def apply_into(
        self,
        out: np.ndarray,
        payload: np.ndarray,
        itemsize: int,
        name: str,
        source: np.ndarray | None = None,
        digest: Digest | None = None,
    ) -> np.ndarray:
        what = f"{self.delta_encoding} payload of {name!r}"
        raw = np.ascontiguousarray(payload, dtype=np.uint8).data.cast("B")
        if len(raw) < 3 or raw[0] != self.tag:
            raise CorruptPayload(
                f"{what} does not start with the {self.delta_encoding} tag {self.tag:#x}"
            )
        width, block_log2 = raw[1], raw[2]
        count, offset = read_varint(raw, 3, what)
        changed, offset = read_varint(raw, offset, what)
        if width != itemsize or count * width != out.size:
            raise CorruptPayload(
                f"{what} describes {count} elements of {width} bytes, but the tensor has "
                f"{out.size // itemsize} elements of {itemsize}; it belongs to another tensor"
            )
        if not 8 <= block_log2 <= 31 or changed > count:
            raise CorruptPayload(
                f"{what} has an invalid header (block size 2**{block_log2}, "
                f"{changed} changed of {count})"
            )
        size = 1 << block_log2
        lengths = []
        for _ in range(-(-count // size) - 1):
            length, offset = read_varint(raw, offset, what)
            lengths.append(length)
        if offset + sum(lengths) >= len(raw):
            raise CorruptPayload(
                f"{what} is {len(raw)} bytes but its block table needs more; it is "
                "truncated or corrupt"
            )
        lengths.append(len(raw) - offset - sum(lengths))  # the last block takes the rest
        if source is not None and source.size != out.size:
            raise ValueError(f"source of {name!r} is {source.size} bytes, out {out.size}")
        bits = out.view(ELEMENT_BITS[width])
        old = None if source is None else read_only(source.view(ELEMENT_BITS[width]))
        jobs = []
        for index, length in enumerate(lengths):
            jobs.append((index, raw[offset : offset + length]))
            offset += length
        # With `digest`, each block is hashed as soon as it and every block before it are
        # applied, while its bytes are in cache.
        in_order = None
        if digest is not None:
            in_order = BlocksInOrder(
                digest, len(jobs), lambda i: bits[i * size : (i + 1) * size].data
            )

        def apply(job: tuple[int, memoryview]) -> np.ndarray:
            index, block = job
            start = index * size
            part = bits[start : start + size]
            before = None if old is None else old[start : start + size]
            positions = self._apply_block(part, block, f"{what} block {index}", before)
            if in_order is not None:
                in_order.finished(index)
            if start:  # a pass over every position (25 MB at 10 % of 32 M): not for block 0
                positions += start
            return positions

        # Blocks come back in order, so the concatenation is sorted.
        per_block = map_blocks(apply, jobs)
        applied = sum(p.size for p in per_block)
        if applied != changed:
            raise CorruptPayload(f"{what} declares {changed} changes but its blocks hold {applied}")
        if len(per_block) == 1:  # most tensors: no copy of their positions
            return per_block[0]
        return np.concatenate(per_block) if per_block else np.empty(0, dtype=np.int64)
