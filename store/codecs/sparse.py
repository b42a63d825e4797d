"""The `sparse` codec (`delta_encoding: "sparse-v1"`): Tether's own delta, near the entropy.

An RL step at a small learning rate flips a few percent of BF16 values, almost all by one
unit in the last place. XOR+zstd spends bytes on the long zero runs in between; this codec
stores only the changed elements: their positions as gaps, and their bits. Each stream is
split into byte planes (a gap's high bytes and a value's sign/exponent byte are nearly
constant) and each plane is its own zstd frame. Values are stored either as the new bits or
as new XOR old bits, whichever compresses smaller for that tensor. `docs/format.md` specifies
the byte layout exactly. Elements are compared as unsigned integers of their width, so NaN
payloads and -0.0 round-trip bit for bit.

Encode and decode are vectorised numpy; memory beyond the two tensors stays within about one
boolean per element plus the changed elements' streams.
"""

from __future__ import annotations

import struct

import numpy as np

from store.checksum import Digest
from store.codecs.zstd_frames import ZstdContexts, decompress_exact
from store.errors import CorruptPayload
from store.tensors import ELEMENT_BITS, RawTensor, as_buffer

MAGIC = b"TSP1"
VALUES_NEW = 0  # planes hold the changed elements' new bits
VALUES_XOR = 1  # planes hold new XOR old bits of the changed elements
VALUES_STEP = 2  # planes hold zigzag(order(new) - order(old)): how many representable values moved
# magic, element size, value mode, gap width, reserved, element count, changed count
_HEADER = struct.Struct("<4sBBBBQQ")
ZSTD_LEVEL = 1  # smaller and ~3x faster than 3 on these near-random planes (measured)


_MODE_SAMPLE = 1 << 16  # changed elements inspected to pick the value representation
_SCAN_CHUNK = 1 << 18  # elements compared per step


def scan_changes(
    new: np.ndarray, old: np.ndarray, gap_type: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gaps between changed elements and their new and old bits, chunk by chunk.

    The comparison mask is one cache-sized chunk (twice as fast as a tensor-wide mask) and no
    tensor-wide index array is built: per changed element it keeps one gap and two values.
    """
    mask = np.empty(min(_SCAN_CHUNK, new.size), dtype=bool)
    gaps, news, olds = [], [], []
    last = -1  # position of the previous change
    for start in range(0, new.size, _SCAN_CHUNK):
        stop = min(new.size, start + _SCAN_CHUNK)
        chunk_mask = mask[: stop - start]
        np.not_equal(new[start:stop], old[start:stop], out=chunk_mask)
        hits = np.flatnonzero(chunk_mask)
        if not hits.size:
            continue
        chunk_gaps = np.diff(hits, prepend=last - start)
        chunk_gaps -= 1
        gaps.append(chunk_gaps.astype(gap_type))
        news.append(new[start:stop][hits])
        olds.append(old[start:stop][hits])
        last = start + int(hits[-1])
    if not gaps:
        empty = np.empty(0, dtype=new.dtype)
        return np.empty(0, dtype=gap_type), empty, empty
    return np.concatenate(gaps), np.concatenate(news), np.concatenate(olds)


def _values(mode: int, new_values: np.ndarray, old_values: np.ndarray) -> np.ndarray:
    """The changed elements' values as `mode` stores them."""
    if mode == VALUES_STEP:
        return zigzag(float_order(new_values) - float_order(old_values))
    if mode == VALUES_XOR:
        stored: np.ndarray = new_values ^ old_values
        return stored
    return new_values


def byte_planes(values: np.ndarray, width: int) -> list[np.ndarray]:
    """Split unsigned ints of `width` bytes into byte planes, least significant first."""
    as_bytes = values.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(as_bytes[:, j]) for j in range(width)]


def float_order(bits: np.ndarray) -> np.ndarray:
    """Map IEEE-style bit patterns to unsigned ints in numeric order (a bijection on all bits).

    Positive patterns get the sign bit set, negative ones are inverted, so adjacent floats map
    to adjacent integers and a one-ulp move becomes +-1 whatever the sign or exponent.
    """
    top = bits.dtype.type(8 * bits.dtype.itemsize - 1)
    ones = bits.dtype.type(np.iinfo(bits.dtype).max)
    sign = bits.dtype.type(1) << top
    keys: np.ndarray = bits ^ (((bits >> top) * ones) | sign)
    return keys


def float_unorder(keys: np.ndarray) -> np.ndarray:
    """Inverse of `float_order`."""
    top = keys.dtype.type(8 * keys.dtype.itemsize - 1)
    ones = keys.dtype.type(np.iinfo(keys.dtype).max)
    sign = keys.dtype.type(1) << top
    bits: np.ndarray = keys ^ ((((keys >> top) ^ keys.dtype.type(1)) * ones) | sign)
    return bits


def zigzag(d: np.ndarray) -> np.ndarray:
    """Wrapped difference -> small unsigned int: 0, -1, 1, -2, ... become 0, 1, 2, 3, ..."""
    top = d.dtype.type(8 * d.dtype.itemsize - 1)
    ones = d.dtype.type(np.iinfo(d.dtype).max)
    z: np.ndarray = (d << d.dtype.type(1)) ^ ((d >> top) * ones)
    return z


def unzigzag(z: np.ndarray) -> np.ndarray:
    ones = z.dtype.type(np.iinfo(z.dtype).max)
    d: np.ndarray = (z >> z.dtype.type(1)) ^ ((z & z.dtype.type(1)) * ones)
    return d


def _plane_entropy(planes: list[np.ndarray]) -> float:
    """Sum of the planes' order-0 entropies, in bits."""
    total = 0.0
    for plane in planes:
        counts = np.bincount(plane, minlength=256)
        counts = counts[counts > 0]
        total -= float((counts * np.log2(counts / plane.size)).sum())
    return total


def join_planes(planes: list[np.ndarray], width: int) -> np.ndarray:
    joined = np.empty((planes[0].size, width), dtype=np.uint8)
    for j, plane in enumerate(planes):
        joined[:, j] = plane
    return joined.reshape(-1).view(ELEMENT_BITS[width])


class SparseCodec:
    name = "sparse"
    delta_encoding = "sparse-v1"

    def __init__(self, level: int = ZSTD_LEVEL) -> None:
        self._zstd = ZstdContexts(level)

    def _frames(self, planes: list[np.ndarray]) -> list[bytes]:
        # An all-zero plane is stored as an empty stream: a gap's top bytes usually are.
        return [self._zstd.compressor.compress(as_buffer(p)) if p.any() else b"" for p in planes]

    def encode_tensor(self, target: RawTensor, base: RawTensor) -> np.ndarray | None:
        width = target.itemsize
        new, old = target.bits(), base.bits()
        gap_width = 4 if new.size <= 2**32 else 8
        gaps, new_values, old_values = scan_changes(new, old, ELEMENT_BITS[gap_width])
        changed = int(gaps.size)
        if changed == 0:
            return None
        # Keep the value representation whose byte planes have the least order-0 entropy on
        # a sample (a cheap stand-in for compressing all three; ties go to the first listed).
        sample_new, sample_old = new_values[:_MODE_SAMPLE], old_values[:_MODE_SAMPLE]
        mode = min(
            (VALUES_STEP, VALUES_XOR, VALUES_NEW),
            key=lambda m: _plane_entropy(byte_planes(_values(m, sample_new, sample_old), width)),
        )
        value_frames = self._frames(byte_planes(_values(mode, new_values, old_values), width))
        frames = self._frames(byte_planes(gaps, gap_width)) + value_frames
        header = _HEADER.pack(MAGIC, width, mode, gap_width, 0, int(new.size), changed)
        lengths = struct.pack(f"<{len(frames)}Q", *map(len, frames))
        return np.frombuffer(b"".join([header, lengths, *frames]), dtype=np.uint8)

    def apply_into(
        self,
        out: np.ndarray,
        payload: np.ndarray,
        itemsize: int,
        name: str,
        source: np.ndarray | None = None,
        digest: Digest | None = None,
    ) -> np.ndarray:
        positions = self._apply(out, payload, itemsize, name, source)
        if digest is not None:
            digest.update(out.data)
        return positions

    def _apply(
        self,
        out: np.ndarray,
        payload: np.ndarray,
        itemsize: int,
        name: str,
        source: np.ndarray | None,
    ) -> np.ndarray:
        what = f"sparse payload of {name!r}"
        if source is not None:  # sparse-v1 is read only for old versions: copy, then patch
            np.copyto(out, source)
        raw = as_buffer(payload if payload.flags.c_contiguous else payload.tobytes())
        if payload.size < _HEADER.size:
            raise CorruptPayload(f"{what} is {payload.size} bytes, shorter than its header")
        magic, width, mode, gap_width, reserved, count, changed = _HEADER.unpack_from(raw, 0)
        if magic != MAGIC:
            raise CorruptPayload(f"{what} starts with {magic!r}, expected {MAGIC!r}")
        if width != itemsize or count * width != out.size:
            raise CorruptPayload(
                f"{what} describes {count} elements of {width} bytes, but the tensor has "
                f"{out.size // itemsize} elements of {itemsize}; it belongs to another tensor"
            )
        if (
            mode not in (VALUES_NEW, VALUES_XOR, VALUES_STEP)
            or gap_width not in (4, 8)
            or reserved != 0
            or changed > count
        ):
            raise CorruptPayload(
                f"{what} has an invalid header (value mode {mode}, gap width {gap_width}, "
                f"reserved {reserved}, {changed} changed of {count})"
            )
        n_frames = gap_width + width
        lengths_end = _HEADER.size + 8 * n_frames
        if payload.size < lengths_end:
            raise CorruptPayload(f"{what} is truncated inside its stream table")
        lengths = struct.unpack_from(f"<{n_frames}Q", raw, _HEADER.size)
        if lengths_end + sum(lengths) != payload.size:
            raise CorruptPayload(
                f"{what} is {payload.size} bytes but its stream table adds up to "
                f"{lengths_end + sum(lengths)}; it is truncated or corrupt"
            )
        if changed == 0:
            return np.empty(0, dtype=np.int64)
        planes = []
        start = lengths_end
        for j, length in enumerate(lengths):
            if length == 0:
                planes.append(np.zeros(changed, dtype=np.uint8))
            else:
                frame = payload[start : start + length]
                data = decompress_exact(
                    self._zstd.decompressor, frame, changed, f"{what} stream {j}"
                )
                planes.append(np.frombuffer(data, dtype=np.uint8))
            start += length
        gaps = join_planes(planes[:gap_width], gap_width)
        if int(gaps.max()) >= count:
            raise CorruptPayload(f"{what} has a gap past the end of the tensor")
        positions = np.cumsum(gaps, dtype=np.int64)
        positions += np.arange(1, changed + 1, dtype=np.int64)
        positions -= 1
        if int(positions[-1]) >= count:
            raise CorruptPayload(
                f"{what} places a change at element {int(positions[-1])} of {count}"
            )
        values = join_planes(planes[gap_width:], width)
        bits = out.view(ELEMENT_BITS[width])
        if mode == VALUES_XOR:
            bits[positions] ^= values
        elif mode == VALUES_STEP:
            bits[positions] = float_unorder(float_order(bits[positions]) + unzigzag(values))
        else:
            bits[positions] = values
        return positions
