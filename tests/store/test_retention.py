"""Retention: gc keeps the newest versions and every anchor and delta they need."""

from __future__ import annotations

import pytest

from store.errors import InvalidVersion, VersionNotFound
from store.retention import versions_to_keep
from store.store import Store
from tests.store.chain import publish_chain, same_tensors

# 0 F, 1-2 D, 3 F, 4-6 D
BASES = {0: None, 1: 0, 2: 1, 3: None, 4: 3, 5: 4, 6: 5}


def test_keeping_the_newest_keeps_the_anchor_and_deltas_they_need() -> None:
    kept = versions_to_keep(BASES, 2, base_of=BASES.get, pointer=6)
    assert kept == {3, 4, 5, 6}


def test_the_pointers_chain_is_kept_even_when_it_is_not_among_the_newest() -> None:
    kept = versions_to_keep(BASES, 1, base_of=BASES.get, pointer=2)
    assert kept == {0, 1, 2, 3, 4, 5, 6}


def test_keep_must_be_positive() -> None:
    for keep in (0, -1, True):
        with pytest.raises(InvalidVersion, match="keep"):
            versions_to_keep(BASES, keep, base_of=BASES.get, pointer=None)


def test_gc_deletes_what_no_kept_version_needs(store: Store) -> None:
    history = publish_chain(store, "run-a", "FDDFDDD")
    report = store.gc("run-a", keep=2)
    assert report.kept == [3, 4, 5, 6]
    assert report.deleted == [0, 1, 2]
    assert report.bytes_freed > 0 and report.objects_deleted >= 6
    assert store.list_versions("run-a") == [3, 4, 5, 6]
    assert same_tensors(store.materialize("run-a", 6), history[6])
    assert same_tensors(store.materialize("run-a", 5), history[5])


def test_gc_dry_run_deletes_nothing(store: Store) -> None:
    publish_chain(store, "run-a", "FDFD")
    report = store.gc("run-a", keep=1, dry_run=True)
    assert report.dry_run and report.deleted == [0, 1] and report.bytes_freed > 0
    assert store.list_versions("run-a") == [0, 1, 2, 3]


def test_gc_removes_incomplete_folders_below_the_pointer_only(store: Store) -> None:
    history = publish_chain(store, "run-a", "FDFD")
    # Debris of dead publishers: v1 lost its index (below the pointer, so dead for sure);
    # v9 holds a lone shard (above the pointer: maybe still uploading).
    assert store.objects.delete("run-a/updates/weight_v000001/model.safetensors.index.json")
    store.objects.put("run-a/updates/weight_v000009/model-00001-of-00002.safetensors", b"x")
    report = store.gc("run-a", keep=1)
    assert report.kept == [2, 3]
    assert report.deleted == [0]
    assert report.incomplete_deleted == [1]
    assert [info.ref.version for info in store.version_infos("run-a")] == [2, 3, 9]
    assert same_tensors(store.materialize("run-a", 3), history[3])


def test_gc_of_an_unknown_run_is_a_clear_error(store: Store) -> None:
    with pytest.raises(VersionNotFound, match="'nope'"):
        store.gc("nope", keep=1)
