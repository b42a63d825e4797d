"""The store's runs, versions, layout and input checks, on every backend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from store.codecs import encode_version
from store.errors import (
    AlreadyExists,
    CorruptPayload,
    InvalidName,
    InvalidVersion,
    VersionNotFound,
)
from store.layout import validate_file_name
from store.manifest import INDEX_FILENAME
from store.objects.local import LocalObjects
from store.store import Store
from store.tensors import RawTensor
from store.types import VersionKind, VersionRef
from tests.store.chain import publish_chain, same_tensors


def full_files(tensors: dict[str, RawTensor], version: int) -> dict[str, bytes]:
    return encode_version(
        tensors, None, version=version, base_version=None, codec="full", shard_bytes=16_384
    )


def test_create_run_is_idempotent_for_identical_metadata(store: Store) -> None:
    first = store.create_run("run-a", boot_version=3, base_checkpoint="hf://qwen")
    again = store.create_run("run-a", boot_version=3, base_checkpoint="hf://qwen")
    assert again == first
    assert store.read_run("run-a").boot_version == 3
    assert store.list_runs() == ["run-a"]


def test_create_run_with_different_metadata_is_refused(store: Store) -> None:
    store.create_run("run-a", boot_version=0)
    with pytest.raises(AlreadyExists, match="boot_version=0"):
        store.create_run("run-a", boot_version=5)
    assert store.read_run("run-a").boot_version == 0


def test_unknown_run_is_a_clear_error(store: Store) -> None:
    store.create_run("known")
    with pytest.raises(VersionNotFound, match=r"'unknown'.*runs: known"):
        store.read_run("unknown")


@pytest.mark.parametrize("run_id", ["", "..", "a/b", "/abs", "a\\b", "x" * 200, "-lead"])
def test_bad_run_ids_are_refused_and_nothing_is_written(store: Store, run_id: str) -> None:
    with pytest.raises(InvalidName):
        store.create_run(run_id)
    assert store.list_runs() == []


@pytest.mark.parametrize(
    "name", ["../evil.safetensors", "/etc/passwd", "a/../b", "a\\b", "", "a//b", "C:/x", "./a"]
)
def test_file_names_that_escape_the_version_folder_are_refused(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_file_name(name)


@pytest.mark.parametrize("name", ["../escape.safetensors", "/abs.safetensors", "sub\\x"])
def test_publish_with_an_unsafe_key_writes_nothing(
    store: Store, checkpoint: dict[str, RawTensor], name: str
) -> None:
    store.create_run("run-a")
    files = full_files(checkpoint, 0)
    files[name] = b"payload"
    with pytest.raises(InvalidName):
        store.publish(VersionRef("run-a", 0), files)
    assert store.version_infos("run-a") == []
    assert store.read_pointer("run-a") is None


def test_publish_to_an_unknown_run_writes_nothing(
    store: Store, checkpoint: dict[str, RawTensor]
) -> None:
    with pytest.raises(VersionNotFound, match="'ghost'"):
        store.publish(VersionRef("ghost", 0), full_files(checkpoint, 0))
    assert store.list_runs() == []


def test_files_whose_index_names_another_version_are_refused(
    store: Store, checkpoint: dict[str, RawTensor]
) -> None:
    store.create_run("run-a")
    with pytest.raises(InvalidVersion, match="index says version 4"):
        store.publish(VersionRef("run-a", 5), full_files(checkpoint, 4))
    assert store.version_infos("run-a") == []


def test_files_missing_a_shard_are_refused(store: Store, checkpoint: dict[str, RawTensor]) -> None:
    store.create_run("run-a")
    files = full_files(checkpoint, 0)
    shard = next(name for name in files if name != INDEX_FILENAME)
    del files[shard]
    with pytest.raises(CorruptPayload, match="not in the files"):
        store.publish(VersionRef("run-a", 0), files)
    assert store.version_infos("run-a") == []


def test_layout_matches_stitch(store: Store, checkpoint: dict[str, RawTensor]) -> None:
    store.create_run("run-a")
    files = full_files(checkpoint, 7)
    store.publish(VersionRef("run-a", 7), files)
    objects = store.objects
    assert objects.get("run-a/latest") == b"run-a/weight_v000007"
    assert json.loads(objects.get("run-a/run.json"))["run_id"] == "run-a"
    for name, data in files.items():
        assert objects.get(f"run-a/updates/weight_v000007/{name}") == data


def test_versions_are_listed_only_when_complete(
    store: Store, checkpoint: dict[str, RawTensor]
) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 0), full_files(checkpoint, 0))
    # A second version whose index arrived but one shard did not (a writer that died).
    files = full_files(checkpoint, 1)
    shards = sorted(name for name in files if name != INDEX_FILENAME)
    assert len(shards) > 1
    for name in [*shards[1:], INDEX_FILENAME]:
        store.objects.put(f"run-a/updates/weight_v000001/{name}", files[name])
    assert store.list_versions("run-a") == [0]
    assert [info.complete for info in store.version_infos("run-a")] == [True, False]
    with pytest.raises(VersionNotFound):
        store.open_version(VersionRef("run-a", 1))


def test_read_manifest_describes_full_and_delta_versions(store: Store) -> None:
    publish_chain(store, "run-a", "FD")
    full = store.read_manifest(VersionRef("run-a", 0))
    delta = store.read_manifest(VersionRef("run-a", 1))
    assert (full.kind, full.base_version) == (VersionKind.FULL, None)
    assert (delta.kind, delta.base_version, delta.version) == (VersionKind.DELTA, 0, 1)
    with pytest.raises(VersionNotFound):
        store.read_manifest(VersionRef("run-a", 2))


def test_a_complete_version_is_immutable(store: Store, checkpoint: dict[str, RawTensor]) -> None:
    store.create_run("run-a")
    original = full_files(checkpoint, 0)
    store.publish(VersionRef("run-a", 0), original)
    changed = {k: RawTensor(t.dtype, t.shape, t.data ^ np.uint8(1)) for k, t in checkpoint.items()}
    with pytest.raises(AlreadyExists, match="immutable"):
        store.write_version(VersionRef("run-a", 0), full_files(changed, 0))
    files = store.open_version(VersionRef("run-a", 0))
    assert {name: files[name] for name in files} == original


def test_open_version_reads_headers_by_range_and_caches_verified_copies(
    store_options: tuple[str, dict], checkpoint: dict[str, RawTensor], tmp_path
) -> None:
    url, options = store_options
    writer = Store(url, storage_options=options)
    writer.create_run("run-a")
    files = full_files(checkpoint, 0)
    writer.publish(VersionRef("run-a", 0), files)
    cache = tmp_path / "cache"
    reader = Store(url, storage_options=options, cache_dir=cache)
    opened = reader.open_version(VersionRef("run-a", 0))
    shard = next(name for name in opened if name != INDEX_FILENAME)
    header = opened.header(shard)
    assert set(header) - {"__metadata__"} <= set(checkpoint)
    assert opened.bytes_fetched == 0  # the header came from ranged reads only
    assert {name: opened[name] for name in opened} == files
    cached = next(cache.rglob(shard))
    cached.write_bytes(b"\0" * cached.stat().st_size)  # damage the cached copy
    again = reader.open_version(VersionRef("run-a", 0))
    assert again[shard] == files[shard]
    assert again.bytes_fetched == len(files[shard])


def test_a_stitch_run_without_run_json_is_readable(store: Store) -> None:
    history = publish_chain(store, "run-a", "FD")
    assert store.objects.delete("run-a/run.json")
    assert store.read_run("run-a").boot_version == 0
    assert same_tensors(store.materialize("run-a", 1), history[1])


@pytest.mark.parametrize("url", ["gs://bucket/x", "", "ftp://host/a", "s3:///no-bucket"])
def test_unsupported_store_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidName):
        Store(url)


class ReadsRecorded(LocalObjects):
    """The folder adapter, recording the key of every object read (an instrument)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read: list[str] = []

    def get(self, key: str) -> bytes:
        self.read.append(key)
        return super().get(key)


def test_a_catch_up_plan_reads_the_chain_it_walks_not_the_runs_whole_history(
    tmp_path: Path,
) -> None:
    objects = ReadsRecorded(tmp_path / "store")
    store = Store(str(tmp_path / "store"), objects=objects)
    publish_chain(store, "long", "FDDDDDDDDDDDDDDDFDDD")  # 20 versions, anchors at 0 and 16

    objects.read.clear()
    plan = store.plan_catch_up("long", 19, have=18)
    assert plan.from_have and plan.downloads == (19,)
    assert objects.read == [f"long/updates/weight_v000019/{INDEX_FILENAME}"], (
        "only the target's index is read"
    )

    objects.read.clear()
    plan = store.plan_catch_up("long", 19)  # no base held: back to the anchor at 16
    assert plan.downloads == (16, 17, 18, 19)
    assert sorted(objects.read) == [
        f"long/updates/weight_v{v:06d}/{INDEX_FILENAME}" for v in (16, 17, 18, 19)
    ]
