"""The index file: Stitch's metadata keys, round trips, and clear errors for bad ones."""

from __future__ import annotations

import json

import pytest

from store.errors import CorruptPayload, InvalidName
from store.manifest import Manifest
from store.types import VersionKind


def test_delta_index_uses_stitchs_keys_and_six_digit_versions():
    manifest = Manifest(
        version=7,
        kind=VersionKind.DELTA,
        base_version=6,
        delta_encoding="xor",
        compression_format="zstd",
        checksum_format="xxh3-128",
        weight_map={"w": "model-00000-of-00001.safetensors"},
    )
    index = json.loads(manifest.to_index_json())
    assert index["metadata"] == {
        "version": "000007",
        "base_version": "000006",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "xxh3-128",
    }
    assert Manifest.from_index_json(manifest.to_index_json()) == manifest


def test_full_index_has_total_size_and_no_delta_keys():
    manifest = Manifest(
        7, VersionKind.FULL, None, None, None, "xxh3-128", {"w": "a.safetensors"}, 12
    )
    index = json.loads(manifest.to_index_json())
    assert index["metadata"] == {
        "total_size": 12,
        "version": "000007",
        "checksum_format": "xxh3-128",
    }
    parsed = Manifest.from_index_json(manifest.to_index_json())
    assert parsed.kind is VersionKind.FULL and parsed.total_size == 12


def test_versions_past_six_digits_keep_every_digit():
    manifest = Manifest(1234567, VersionKind.FULL, None, None, None, None, {}, 0)
    assert json.loads(manifest.to_index_json())["metadata"]["version"] == "1234567"
    assert Manifest.from_index_json(manifest.to_index_json()).version == 1234567


def test_shard_files_are_listed_once_each_sorted():
    manifest = Manifest(
        1,
        VersionKind.FULL,
        None,
        None,
        None,
        None,
        {"a": "z.safetensors", "b": "y.safetensors", "c": "z.safetensors"},
    )
    assert manifest.shard_files() == ["y.safetensors", "z.safetensors"]


@pytest.mark.parametrize(
    "index",
    [
        b"not json",
        b"[]",
        b'{"weight_map": {}}',
        b'{"metadata": {"version": "abc"}, "weight_map": {}}',
        b'{"metadata": {"version": "000001"}}',
        b'{"metadata": {"version": "000001", "delta_encoding": "xor"}, "weight_map": {}}',
    ],
    ids=["not-json", "not-object", "no-version", "bad-version", "no-weight-map", "delta-no-base"],
)
def test_malformed_index_is_corrupt(index):
    with pytest.raises(CorruptPayload):
        Manifest.from_index_json(index)


@pytest.mark.parametrize(
    "weight_map",
    [{"w": "../escape.safetensors"}, {"w": "/abs.safetensors"}, {"../w": "a.safetensors"}],
)
def test_index_naming_paths_outside_the_version_is_refused(weight_map):
    index = json.dumps({"metadata": {"version": "000001"}, "weight_map": weight_map})
    with pytest.raises(InvalidName):
        Manifest.from_index_json(index.encode())
