"""Stitch's delta layout, written here by an independent minimal writer (xxhash, zstandard and
hand-built safetensors bytes; none of Tether's encoder), is read and applied correctly, and
Tether's `xor` output equals it byte for byte.

What the writer encodes, as Stitch's trainer does: per changed tensor, a 1-D U8 tensor of the
same name holding `zstd(level=1)(target XOR base)`; each shard's `__metadata__` maps tensor name
-> xxh3-128 hex digest of the target bytes; shards `model-{i:05d}-of-{n:05d}.safetensors`
numbered from 0; index metadata `version`/`base_version` as six-digit strings, then
`delta_encoding: xor`, `compression_format: zstd`, `checksum_format: xxh3-128`, written with
`json.dumps` defaults.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import safetensors.numpy
import xxhash
import zstandard

from store.codecs import decode_version, encode_version, fold
from store.safetensors_io import load
from store.tensors import RawTensor
from tests.store.tensor_cases import same_bits


def stitch_shard(payloads: dict[str, bytes], checksums: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": dict(sorted(checksums.items()))}
    offset = 0
    for name in sorted(payloads):
        header[name] = {
            "dtype": "U8",
            "shape": [len(payloads[name])],
            "data_offsets": [offset, offset + len(payloads[name])],
        }
        offset += len(payloads[name])
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(payloads[n] for n in sorted(payloads))


def stitch_delta(
    base: dict[str, bytes], target: dict[str, bytes], version: int, ranks: int = 1
) -> dict[str, bytes]:
    """Stitch's xor delta of `target` against `base`, split over `ranks` trainer ranks."""
    changed = []
    for name, new in target.items():
        diff = (np.frombuffer(new, np.uint8) ^ np.frombuffer(base[name], np.uint8)).tobytes()
        if any(diff):
            payload = zstandard.ZstdCompressor(level=1).compress(diff)
            changed.append((name, payload, xxhash.xxh3_128(new).hexdigest()))
    per_rank = [changed[r::ranks] for r in range(ranks)]
    per_rank = [group for group in per_rank if group]
    files, weight_map = {}, {}
    for i, group in enumerate(per_rank):
        shard = f"model-{i:05d}-of-{len(per_rank):05d}.safetensors"
        files[shard] = stitch_shard({n: p for n, p, _ in group}, {n: c for n, _, c in group})
        weight_map.update({n: shard for n, _, _ in group})
    index = {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": "xor",
            "compression_format": "zstd",
            "checksum_format": "xxh3-128",
        },
        "weight_map": weight_map,
    }
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


def checkpoint(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": RawTensor(
            "BF16", (64, 8), rng.integers(0, 256, 1024, np.uint8)
        ),
        "model.layers.0.self_attn.q_proj.weight": RawTensor(
            "BF16", (8, 8), rng.integers(0, 256, 128, np.uint8)
        ),
        "model.layers.0.mlp.down_proj.weight_scale_inv": RawTensor(
            "F32", (3,), rng.integers(0, 256, 12, np.uint8)
        ),
        "model.norm.weight": RawTensor("BF16", (8,), rng.integers(0, 256, 16, np.uint8)),
    }


def step(tensors: dict[str, RawTensor], seed: int, skip: str) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        data = t.data.copy()
        if name != skip:
            data[rng.random(data.size) < 0.1] ^= 1
        out[name] = RawTensor(t.dtype, t.shape, data)
    return out


def as_bytes(tensors: dict[str, RawTensor]) -> dict[str, bytes]:
    return {n: t.data.tobytes() for n, t in tensors.items()}


def test_tether_reads_and_applies_a_stitch_written_delta():
    v0 = checkpoint(0)
    v1 = step(v0, 1, skip="model.norm.weight")
    files = stitch_delta(as_bytes(v0), as_bytes(v1), version=1)
    assert (
        "model.norm.weight" not in json.loads(files["model.safetensors.index.json"])["weight_map"]
    )
    assert same_bits(decode_version(files, v0), v1)


def test_tether_folds_a_chain_of_multi_rank_stitch_deltas():
    v0 = checkpoint(0)
    v1 = step(v0, 1, skip="model.norm.weight")
    v2 = step(v1, 2, skip="model.layers.0.self_attn.q_proj.weight")
    v3 = step(v2, 3, skip="")
    chain = [
        stitch_delta(as_bytes(a), as_bytes(b), version=i + 1, ranks=2)
        for i, (a, b) in enumerate([(v0, v1), (v1, v2), (v2, v3)])
    ]
    assert "model-00001-of-00002.safetensors" in chain[0]
    assert same_bits(fold(v0, chain), v3)


def test_tether_xor_output_equals_the_stitch_writer_byte_for_byte():
    v0 = checkpoint(0)
    v1 = step(v0, 1, skip="model.norm.weight")
    ours = encode_version(v1, v0, version=7, base_version=6, codec="xor")
    theirs = stitch_delta(as_bytes(v0), as_bytes(v1), version=7)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name] == theirs[name], name


def test_a_shard_saved_by_the_safetensors_library_decodes_too():
    """The reference library orders `__metadata__` keys at random; the reader must not care."""
    v0 = checkpoint(0)
    v1 = step(v0, 1, skip="")
    files = stitch_delta(as_bytes(v0), as_bytes(v1), version=1)
    shard = "model-00000-of-00001.safetensors"
    arrays = safetensors.numpy.load(files[shard])
    _, metadata = load(files[shard])
    files[shard] = safetensors.numpy.save(arrays, metadata=metadata)
    assert same_bits(decode_version(files, v0), v1)
