"""`sparse-v1` as docs/format.md specifies it: a decoder written here from the document alone
agrees with Tether's encoder, and Tether's decoder reads payloads built here by hand."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard

from store.codecs.sparse import SparseCodec
from store.tensors import RawTensor


def doc_order(x: int, w: int) -> int:
    bits = 8 * w
    sign, ones = 1 << (bits - 1), (1 << bits) - 1
    return x ^ (sign | ((x >> (bits - 1)) * ones))


def doc_unorder(y: int, w: int) -> int:
    bits = 8 * w
    sign, ones = 1 << (bits - 1), (1 << bits) - 1
    return y ^ (sign | (((y >> (bits - 1)) ^ 1) * ones))


def doc_unzigzag(z: int, w: int) -> int:
    ones = (1 << (8 * w)) - 1
    return (z >> 1) ^ ((z & 1) * ones)


def doc_decode(payload: bytes, old: list[int], w: int) -> list[int]:
    """Straight from the specification, one element at a time."""
    magic, width, mode, g, reserved, n, k = struct.unpack_from("<4sBBBBQQ", payload, 0)
    assert (magic, width, reserved, n) == (b"TSP1", w, 0, len(old))
    lengths = struct.unpack_from(f"<{g + w}Q", payload, 24)
    offset = 24 + 8 * (g + w)
    assert offset + sum(lengths) == len(payload)
    planes = []
    for length in lengths:
        if length == 0:
            planes.append(bytes(k))
        else:
            planes.append(
                zstandard.ZstdDecompressor().decompress(payload[offset : offset + length])
            )
        offset += length
    gaps = [sum(planes[j][i] << (8 * j) for j in range(g)) for i in range(k)]
    values = [sum(planes[g + j][i] << (8 * j) for j in range(w)) for i in range(k)]
    new = list(old)
    position = -1
    modulus = 1 << (8 * w)
    for gap, value in zip(gaps, values, strict=True):
        position += gap + 1
        if mode == 0:
            new[position] = value
        elif mode == 1:
            new[position] ^= value
        else:
            step = doc_unzigzag(value, w)
            new[position] = doc_unorder((doc_order(old[position], w) + step) % modulus, w)
    return new


def tensor(values: list[int], w: int) -> RawTensor:
    dtype = {1: "U8", 2: "BF16", 4: "F32"}[w]
    return RawTensor(dtype, (len(values),), np.array(values, dtype=f"<u{w}").view(np.uint8))


CASES = {
    # one-ulp moves up and down, across zero and signs: STEP wins
    "step": lambda old, rng: [
        doc_unorder((doc_order(x, 2) + int(rng.choice([-1, 1]))) % 65536, 2) if i % 5 == 0 else x
        for i, x in enumerate(old)
    ],
    # one fixed bit flipped: the XOR pattern is constant, XOR wins
    "xor": lambda old, rng: [x ^ 0x0400 if i % 3 == 0 else x for i, x in enumerate(old)],
    # overwritten with one constant: NEW wins
    "new": lambda old, rng: [0x3F80 if i % 4 == 0 else x for i, x in enumerate(old)],
}


@pytest.mark.parametrize(("case", "mode"), [("step", 2), ("xor", 1), ("new", 0)])
def test_a_decoder_written_from_the_document_reads_tethers_payloads(case, mode):
    rng = np.random.default_rng(5)
    old = [int(x) for x in rng.integers(0, 65536, 300)]
    new = CASES[case](old, rng)
    payload = SparseCodec().encode_tensor(tensor(new, 2), tensor(old, 2))
    assert payload is not None
    assert payload[5] == mode
    assert doc_decode(payload.tobytes(), old, 2) == new


def test_tether_reads_a_hand_built_payload_with_eight_byte_gaps():
    old = list(range(40))
    positions, values = [3, 4, 39], [200, 201, 202]
    gaps = [3, 0, 34]
    g, w, k = 8, 1, 3
    planes = [bytes((gap >> (8 * j)) & 0xFF for gap in gaps) for j in range(g)]
    planes.append(bytes(values))
    streams = [zstandard.ZstdCompressor().compress(p) if any(p) else b"" for p in planes]
    payload = struct.pack("<4sBBBBQQ", b"TSP1", w, 0, g, 0, len(old), k)
    payload += struct.pack(f"<{g + w}Q", *map(len, streams)) + b"".join(streams)
    out = np.array(old, dtype=np.uint8)
    changed = SparseCodec().apply_into(out, np.frombuffer(payload, np.uint8), 1, "hand-built")
    assert changed.tolist() == positions
    expected = list(old)
    for p, v in zip(positions, values, strict=True):
        expected[p] = v
    assert out.tolist() == expected
