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
over blocks in parallel (`store.codecs.workers`). Elements are compared as unsigned integers
of their width, so NaN payloads and -0.0 round-trip bit for bit. `docs/format.md` §5 gives
the byte layout. Never reads or writes anything but the arrays it is given.
"""

from __future__ import annotations

import numpy as np

from store.codecs.bitstreams import (
    pack_fields,
    read_unary,
    read_varint,
    rice_parameter,
    unary_stream,
    unpack_fields,
    write_varint,
)
from store.codecs.sparse import float_order, float_unorder, scan_changes
from store.codecs.workers import map_blocks
from store.codecs.zstd_frames import ZstdContexts, decompress_exact
from store.errors import CorruptPayload
from store.tensors import ELEMENT_BITS, RawTensor

MAGIC = b"TSP2"
BLOCK_LOG2 = 22  # 4 Mi elements: 8 MiB of BF16, a unit of parallel work
VALUES_NEW, VALUES_XOR, VALUES_STEP = 0, 1, 2
STREAM_RAW, STREAM_ZSTD, STREAM_ZERO = 0, 1, 2
ZSTD_LEVEL = 1
_MODE_SAMPLE = 1 << 12  # changed elements inspected to pick a block's value representation
_GAP = np.dtype("<u4")  # gaps inside a block (blocks hold at most 2**31 elements)


def _plane_bits(values: np.ndarray) -> float:
    """Sum of the order-0 entropies of the byte planes of `values`, in bits."""
    width = values.dtype.itemsize
    planes = values.view(np.uint8).reshape(-1, width)
    total = 0.0
    for j in range(width):
        counts = np.bincount(planes[:, j], minlength=256)
        counts = counts[counts > 0]
        total -= float((counts * np.log2(counts / planes.shape[0])).sum())
    return total


def _step_parts(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sign, magnitude) of order(new) - order(old), a nonzero wrapped difference.

    sign = 1 for a move down; magnitude = |difference| - 1, so a one-ulp move is 0.
    """
    step = float_order(new)
    step -= float_order(old)
    down = step >= step.dtype.type(1 << (8 * step.dtype.itemsize - 1))
    np.negative(step, out=step, where=down)
    step -= step.dtype.type(1)
    return down, step


def _choose_mode(new: np.ndarray, old: np.ndarray) -> int:
    """The value representation with the fewest estimated bits on a sample (STEP wins ties)."""
    new, old = new[:_MODE_SAMPLE], old[:_MODE_SAMPLE]
    sign, magnitude = _step_parts(new, old)
    estimates = {
        VALUES_STEP: float(sign.size) + _plane_bits(magnitude),
        VALUES_XOR: _plane_bits(new ^ old),
        VALUES_NEW: _plane_bits(new),
    }
    return min(estimates, key=estimates.__getitem__)


def _byte_planes(values: np.ndarray) -> list[np.ndarray]:
    width = values.dtype.itemsize
    as_bytes = values.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(as_bytes[:, j]) for j in range(width)]


def _join_planes(planes: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    joined = np.empty((planes[0].size, len(planes)), dtype=np.uint8)
    for j, plane in enumerate(planes):
        joined[:, j] = plane
    return joined.reshape(-1).view(dtype)


class SparseV2Codec:
    name = "sparse"
    delta_encoding = "sparse-v2"

    def __init__(self, level: int = ZSTD_LEVEL, block_log2: int = BLOCK_LOG2) -> None:
        self._zstd = ZstdContexts(level)
        self._block_log2 = block_log2

    # -- encoding -------------------------------------------------------------------------

    def _squeeze(self, raw: np.ndarray) -> tuple[int, bytes]:
        """(kind, bytes) of one stream: all zero, a zstd frame, or raw, whichever is smallest."""
        if not raw.any():
            return STREAM_ZERO, b""
        data = raw.tobytes()
        if raw.size >= 32:
            frame = self._zstd.compressor.compress(data)
            if len(frame) < len(data):
                return STREAM_ZSTD, frame
        return STREAM_RAW, data

    def _encode_block(self, new: np.ndarray, old: np.ndarray) -> bytes:
        gaps, new_values, old_values = scan_changes(new, old, _GAP)
        changed = int(gaps.size)
        head = bytearray()
        write_varint(changed, head)
        if changed == 0:
            return bytes(head)
        mode = _choose_mode(new_values, old_values)
        r = rice_parameter(gaps, int(new.size))
        unary, unary_bits = unary_stream(gaps >> _GAP.type(r))
        streams = [pack_fields(gaps, r), unary]
        if mode == VALUES_STEP:
            sign, magnitude = _step_parts(new_values, old_values)
            streams.append(np.packbits(sign))
            streams += _byte_planes(magnitude)
        else:
            values = new_values ^ old_values if mode == VALUES_XOR else new_values
            streams += _byte_planes(values)
        head += bytes((mode, r))
        write_varint(unary_bits, head)
        bodies = []
        for stream in streams:
            kind, body = self._squeeze(stream)
            write_varint(len(body) << 2 | kind, head)
            bodies.append(body)
        return b"".join([bytes(head), *bodies])

    def encode_tensor(self, target: RawTensor, base: RawTensor) -> np.ndarray | None:
        new, old = target.bits(), base.bits()
        size = 1 << self._block_log2
        starts = range(0, new.size, size)
        blocks = map_blocks(
            lambda s: self._encode_block(new[s : s + size], old[s : s + size]), starts
        )
        changed = sum(read_varint(b, 0, "block")[0] for b in blocks)
        if changed == 0:
            return None
        head = bytearray(MAGIC + bytes((target.itemsize, self._block_log2, 0)))
        write_varint(int(new.size), head)
        write_varint(changed, head)
        for block in blocks:
            write_varint(len(block), head)
        return np.frombuffer(b"".join([bytes(head), *blocks]), dtype=np.uint8)

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

    def _apply_block(self, bits: np.ndarray, block: memoryview, what: str) -> int:
        """Patch `bits` (one block of the tensor, as unsigned ints) in place; return k."""
        changed, offset = read_varint(block, 0, what)
        if changed == 0:
            if offset != len(block):
                raise CorruptPayload(f"{what} has no changes but {len(block)} bytes")
            return 0
        if changed > bits.size or offset + 2 > len(block):
            raise CorruptPayload(f"{what} claims {changed} changes in {bits.size} elements")
        mode, r = block[offset], block[offset + 1]
        if mode not in (VALUES_NEW, VALUES_XOR, VALUES_STEP) or r > 62:
            raise CorruptPayload(f"{what} has value mode {mode} and Rice parameter {r}")
        unary_bits, offset = read_varint(block, offset + 2, what)
        if not changed <= unary_bits <= changed + (bits.size >> r):
            raise CorruptPayload(f"{what} declares {unary_bits} unary bits for {changed} gaps")
        width = bits.dtype.itemsize
        sizes = [r * -(-changed // 8), -(-unary_bits // 8)]
        sizes += [-(-changed // 8)] if mode == VALUES_STEP else []
        sizes += [changed] * width
        descriptors = []
        for _ in sizes:
            descriptor, offset = read_varint(block, offset, what)
            descriptors.append(descriptor)
        if offset + sum(d >> 2 for d in descriptors) != len(block):
            raise CorruptPayload(f"{what} is {len(block)} bytes, its stream table disagrees")
        streams = []
        for j, (descriptor, size) in enumerate(zip(descriptors, sizes, strict=True)):
            length = descriptor >> 2
            body = block[offset : offset + length]
            streams.append(self._stream(descriptor & 3, body, size, f"{what} stream {j}"))
            offset += length
        quotients = read_unary(streams[1], unary_bits, changed, what)
        gaps = unpack_fields(streams[0], changed, r, np.dtype(np.int64))
        quotients <<= r
        gaps += quotients
        gaps += 1
        positions = np.cumsum(gaps, out=gaps)
        positions -= 1
        if int(positions[-1]) >= bits.size:
            raise CorruptPayload(f"{what} places a change past the end of its block")
        if mode == VALUES_STEP:
            sign = np.unpackbits(streams[2], count=changed).astype(bool)
            step = _join_planes(streams[3:], bits.dtype)
            step += bits.dtype.type(1)
            np.negative(step, out=step, where=sign)
            bits[positions] = float_unorder(float_order(bits[positions]) + step)
        elif mode == VALUES_XOR:
            bits[positions] ^= _join_planes(streams[2:], bits.dtype)
        else:
            bits[positions] = _join_planes(streams[2:], bits.dtype)
        return changed

    def apply_into(self, out: np.ndarray, payload: np.ndarray, itemsize: int, name: str) -> None:
        what = f"sparse-v2 payload of {name!r}"
        raw = memoryview(np.ascontiguousarray(payload)).cast("B")
        if len(raw) < 7 or bytes(raw[:4]) != MAGIC:
            raise CorruptPayload(f"{what} does not start with {MAGIC!r}")
        width, block_log2, reserved = raw[4], raw[5], raw[6]
        count, offset = read_varint(raw, 7, what)
        changed, offset = read_varint(raw, offset, what)
        if width != itemsize or count * width != out.size:
            raise CorruptPayload(
                f"{what} describes {count} elements of {width} bytes, but the tensor has "
                f"{out.size // itemsize} elements of {itemsize}; it belongs to another tensor"
            )
        if reserved != 0 or not 8 <= block_log2 <= 31 or changed > count:
            raise CorruptPayload(
                f"{what} has an invalid header (block size 2**{block_log2}, reserved "
                f"{reserved}, {changed} changed of {count})"
            )
        size = 1 << block_log2
        lengths = []
        for _ in range(-(-count // size)):
            length, offset = read_varint(raw, offset, what)
            lengths.append(length)
        if offset + sum(lengths) != len(raw):
            raise CorruptPayload(
                f"{what} is {len(raw)} bytes but its block table adds up to "
                f"{offset + sum(lengths)}; it is truncated or corrupt"
            )
        bits = out.view(ELEMENT_BITS[width])
        jobs = []
        for index, length in enumerate(lengths):
            jobs.append((index, raw[offset : offset + length]))
            offset += length

        def apply(job: tuple[int, memoryview]) -> int:
            index, block = job
            start = index * size
            return self._apply_block(bits[start : start + size], block, f"{what} block {index}")

        applied = sum(map_blocks(apply, jobs))
        if applied != changed:
            raise CorruptPayload(f"{what} declares {changed} changes but its blocks hold {applied}")
