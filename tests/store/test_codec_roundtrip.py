"""Every codec round-trips every checkpoint dtype bit for bit (NaN payloads and -0.0 too)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.codecs import CODECS, decode_version, encode_version
from store.manifest import INDEX_FILENAME, Manifest
from store.tensors import RawTensor
from store.types import VersionKind
from tests.store.tensor_cases import CHECKPOINT_DTYPES, chains, same_bits

FAST = settings(max_examples=20, deadline=None)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [*CHECKPOINT_DTYPES, None], ids=[*CHECKPOINT_DTYPES, "mixed"])
@FAST
@given(data=st.data(), shard_bytes=st.sampled_from([1, 64, 2**30]))
def test_every_codec_round_trips_a_successor_checkpoint_exactly(codec, dtype, data, shard_bytes):
    base, target = data.draw(chains(2, dtype))
    files = encode_version(
        target, base, version=3, base_version=2, codec=codec, shard_bytes=shard_bytes
    )
    assert INDEX_FILENAME in files
    decoded = decode_version(files, base if codec != "full" else None)
    assert same_bits(decoded, target)


@pytest.mark.parametrize("codec", ["xor", "sparse"])
@pytest.mark.parametrize("dtype", CHECKPOINT_DTYPES)
def test_delta_keeps_nan_payloads_and_negative_zero_bit_for_bit(codec, dtype):
    width = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}[dtype]
    unsigned = np.dtype(f"<u{width}")
    top = 1 << (8 * width - 1)
    base_bits = np.array([0, top, top - 1, 2 * top - 1, 5, 0, top, 7], dtype=unsigned)
    # +0.0 -> -0.0, -0.0 -> +0.0, one NaN payload -> another, all-ones -> zero, ...
    target_bits = np.array([top, 0, top - 2, 0, 5, 1, top + 1, 7], dtype=unsigned)
    base = {"w": RawTensor(dtype, (2, 4), base_bits.view(np.uint8))}
    target = {"w": RawTensor(dtype, (2, 4), target_bits.view(np.uint8))}
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    assert same_bits(decode_version(files, base), target)


@pytest.mark.parametrize("codec", ["xor", "sparse"])
def test_unchanged_tensors_are_left_out_of_a_delta(codec):
    data = np.arange(32, dtype=np.uint8)
    base = {"a": RawTensor("BF16", (16,), data), "b": RawTensor("U8", (32,), data)}
    target = {"a": base["a"], "b": RawTensor("U8", (32,), data[::-1].copy())}
    files = encode_version(target, base, version=5, base_version=4, codec=codec)
    manifest = Manifest.from_index_json(files[INDEX_FILENAME])
    assert manifest.kind is VersionKind.DELTA
    assert list(manifest.weight_map) == ["b"]
    decoded = decode_version(files, base)
    assert decoded["a"] is base["a"]
    assert same_bits(decoded, target)


def test_a_delta_of_identical_checkpoints_has_an_index_and_no_shards():
    base = {"w": RawTensor("F32", (3,), np.zeros(12, dtype=np.uint8))}
    files = encode_version(base, base, version=1, base_version=0, codec="sparse")
    assert list(files) == [INDEX_FILENAME]
    assert same_bits(decode_version(files, base), base)


def test_full_version_shards_at_the_size_limit_and_records_total_size():
    tensors = {f"t{i}": RawTensor("U8", (100,), np.full(100, i, np.uint8)) for i in range(5)}
    files = encode_version(
        tensors, None, version=0, base_version=None, codec="full", shard_bytes=250
    )
    manifest = Manifest.from_index_json(files[INDEX_FILENAME])
    assert manifest.kind is VersionKind.FULL
    assert manifest.total_size == 500
    assert manifest.shard_files() == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert same_bits(decode_version(files, None), tensors)


def test_sparse_is_much_smaller_than_xor_for_sparse_one_ulp_changes():
    rng = np.random.default_rng(7)
    values = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    moved = bf16.copy()
    hits = rng.random(bf16.size) < 0.03
    moved[hits] += np.where(rng.random(int(hits.sum())) < 0.5, 1, -1).astype(np.uint16)
    base = {"w": RawTensor("BF16", (bf16.size,), bf16.view(np.uint8))}
    target = {"w": RawTensor("BF16", (bf16.size,), moved.view(np.uint8))}
    sizes = {}
    for codec in ("xor", "sparse"):
        files = encode_version(target, base, version=1, base_version=0, codec=codec)
        sizes[codec] = sum(len(b) for b in files.values())
    assert sizes["sparse"] < 0.6 * sizes["xor"]
