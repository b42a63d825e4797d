"""Bad input and bad bytes: each a specific error, and the base is never touched."""

from __future__ import annotations

import json

import numpy as np
import pytest

from store.codecs import decode_version, encode_version, fold, get_codec
from store.errors import (
    ChecksumMismatch,
    CorruptPayload,
    InvalidName,
    TensorMismatch,
    UnknownCodec,
)
from store.manifest import INDEX_FILENAME
from store.safetensors_io import dump, load, read_header
from store.tensors import RawTensor
from tests.store.tensor_cases import same_bits

DELTAS = ["xor", "sparse"]


def frozen(tensors: dict[str, RawTensor]) -> dict[str, RawTensor]:
    """Read-only copies: any attempt to write into the base fails loudly."""
    out = {}
    for name, t in tensors.items():
        data = t.data.copy()
        data.flags.writeable = False
        out[name] = RawTensor(t.dtype, t.shape, data)
    return out


def pair(seed: int = 1) -> tuple[dict[str, RawTensor], dict[str, RawTensor]]:
    rng = np.random.default_rng(seed)
    base_bytes = rng.integers(0, 256, 400, dtype=np.uint8)
    target_bytes = base_bytes.copy()
    target_bytes[::7] ^= 1
    base = frozen({"w": RawTensor("BF16", (200,), base_bytes)})
    target = {"w": RawTensor("BF16", (200,), target_bytes)}
    return base, target


def shard_of(files: dict[str, bytes]) -> str:
    return next(name for name in files if name.endswith(".safetensors"))


def test_unknown_codec_names_the_valid_choices():
    with pytest.raises(UnknownCodec, match="full, xor, sparse"):
        get_codec("gzip")
    base, target = pair()
    with pytest.raises(UnknownCodec):
        encode_version(target, base, version=1, base_version=0, codec="zip")


@pytest.mark.parametrize("codec", ["full", *DELTAS])
@pytest.mark.parametrize("name", ["../escape.weight", "/abs/path.weight", "a/../../b", ""])
def test_tensor_names_with_dot_dot_or_absolute_paths_are_refused(codec, name):
    tensor = RawTensor("U8", (2,), np.zeros(2, np.uint8))
    with pytest.raises(InvalidName):
        encode_version({name: tensor}, {name: tensor}, version=1, base_version=0, codec=codec)


def test_a_shard_naming_a_dot_dot_tensor_is_refused_on_load():
    blob = dump({"ok": RawTensor("U8", (1,), np.zeros(1, np.uint8))})
    header, start = read_header(blob)
    text = json.dumps({"../x": header["ok"]}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    evil = len(text).to_bytes(8, "little") + text + blob[start:]
    with pytest.raises(InvalidName):
        load(evil)


@pytest.mark.parametrize("codec", DELTAS)
def test_shape_mismatch_between_base_and_target_names_the_tensor(codec):
    base, target = pair()
    other_shape = {"w": RawTensor("BF16", (10, 20), target["w"].data)}
    with pytest.raises(TensorMismatch, match="'w'"):
        encode_version(other_shape, base, version=1, base_version=0, codec=codec)


@pytest.mark.parametrize("codec", DELTAS)
def test_dtype_mismatch_between_base_and_target_names_the_tensor(codec):
    base, target = pair()
    other_dtype = {"w": RawTensor("F16", (200,), target["w"].data)}
    with pytest.raises(TensorMismatch, match=r"'w'.*F16"):
        encode_version(other_dtype, base, version=1, base_version=0, codec=codec)


@pytest.mark.parametrize("codec", DELTAS)
def test_tensor_sets_must_match_for_a_delta(codec):
    base, target = pair()
    extra = {**target, "new.weight": RawTensor("U8", (1,), np.zeros(1, np.uint8))}
    with pytest.raises(TensorMismatch, match=r"new\.weight"):
        encode_version(extra, base, version=1, base_version=0, codec=codec)
    with pytest.raises(TensorMismatch, match="needs a base"):
        encode_version(target, None, version=1, base_version=None, codec=codec)


@pytest.mark.parametrize("codec", ["full", *DELTAS])
def test_every_single_byte_corruption_is_caught_or_harmless(codec):
    """Flip each bit 0 and bit 7 of every payload byte: decode raises CorruptPayload (or a
    subclass) or still returns the exact target; it never returns wrong weights."""
    base, target = pair()
    before = {k: t.data.copy() for k, t in base.items()}
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    shard = shard_of(files)
    _, start = read_header(files[shard])
    caught = 0
    for i in range(start, len(files[shard])):
        for bit in (1, 128):
            bad = bytearray(files[shard])
            bad[i] ^= bit
            try:
                decoded = decode_version({**files, shard: bytes(bad)}, base)
            except CorruptPayload:
                caught += 1
                continue
            assert same_bits(decoded, target)
    assert caught > 0
    assert all(np.array_equal(before[k], base[k].data) for k in base)


@pytest.mark.parametrize("codec", ["full", *DELTAS])
def test_truncated_shard_is_corrupt(codec):
    base, target = pair()
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    shard = shard_of(files)
    for cut in (0, 5, 8, len(files[shard]) // 2, len(files[shard]) - 1):
        with pytest.raises(CorruptPayload):
            decode_version({**files, shard: files[shard][:cut]}, base)


@pytest.mark.parametrize("codec", ["full", *DELTAS])
def test_missing_shard_or_index_is_corrupt(codec):
    base, target = pair()
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    without_shard = {k: v for k, v in files.items() if k != shard_of(files)}
    with pytest.raises(CorruptPayload, match="incomplete"):
        decode_version(without_shard, base)
    with pytest.raises(CorruptPayload, match=INDEX_FILENAME):
        decode_version({shard_of(files): files[shard_of(files)]}, base)
    with pytest.raises(CorruptPayload, match="JSON"):
        decode_version({**files, INDEX_FILENAME: b"{not json"}, base)


@pytest.mark.parametrize("codec", DELTAS)
def test_a_delta_applied_to_the_wrong_base_fails_its_checksum(codec):
    base, target = pair(1)
    wrong_base, _ = pair(2)
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    with pytest.raises(ChecksumMismatch, match="'w'"):
        decode_version(files, wrong_base)


@pytest.mark.parametrize("codec", DELTAS)
def test_a_recorded_checksum_that_disagrees_is_a_mismatch(codec):
    base, target = pair()
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    shard = shard_of(files)
    tensors, metadata = load(files[shard])
    metadata["w"] = "0" * 32
    with pytest.raises(ChecksumMismatch):
        decode_version({**files, shard: dump(tensors, metadata)}, base)


@pytest.mark.parametrize(
    ("key", "value"),
    [("delta_encoding", "bsdiff"), ("compression_format", "lz4"), ("checksum_format", "md5")],
)
def test_an_unknown_encoding_compression_or_checksum_in_the_index_is_refused(key, value):
    base, target = pair()
    files = encode_version(target, base, version=1, base_version=0, codec="xor")
    index = json.loads(files[INDEX_FILENAME])
    index["metadata"][key] = value
    with pytest.raises(UnknownCodec, match=value):
        decode_version({**files, INDEX_FILENAME: json.dumps(index).encode()}, base)


@pytest.mark.parametrize("codec", DELTAS)
def test_a_delta_for_a_tensor_the_base_lacks_is_refused(codec):
    base, target = pair()
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    renamed = {"other": RawTensor("BF16", (200,), base["w"].data)}
    with pytest.raises(TensorMismatch, match="'w'"):
        decode_version(files, renamed)


@pytest.mark.parametrize("codec", DELTAS)
def test_a_payload_for_a_tensor_of_another_size_is_corrupt(codec):
    base, target = pair()
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    smaller = {"w": RawTensor("BF16", (100,), base["w"].data[:200])}
    with pytest.raises(CorruptPayload):
        fold(smaller, [files])
