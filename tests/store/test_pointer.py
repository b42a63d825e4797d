"""The pointer: forward only, compare-and-swap, never at incomplete bytes."""

from __future__ import annotations

import pytest

from store.codecs import encode_version
from store.errors import (
    CorruptPayload,
    InvalidName,
    InvalidVersion,
    PointerConflict,
    PointerRewind,
    VersionNotFound,
)
from store.pointer import READ_NOW
from store.store import Store
from store.synthetic import random_checkpoint
from store.types import VersionRef
from tests.store.chain import race


def write(store: Store, run_id: str, version: int, seed: int = 0) -> VersionRef:
    ref = VersionRef(run_id, version)
    files = encode_version(
        random_checkpoint(seed=seed), None, version=version, base_version=None, codec="full"
    )
    store.write_version(ref, files)
    return ref


def test_pointer_is_unset_until_the_first_move(store: Store) -> None:
    store.create_run("run-a")
    assert store.read_pointer("run-a") is None
    v0 = write(store, "run-a", 0)
    assert store.read_pointer("run-a") is None  # written, not published
    assert store.move_pointer("run-a", None, v0) is None
    assert store.read_pointer("run-a") == v0


def test_pointer_never_moves_backwards_within_a_run(store: Store) -> None:
    store.create_run("run-a")
    v1, v2 = write(store, "run-a", 1), write(store, "run-a", 2)
    store.move_pointer("run-a", None, v2)
    with pytest.raises(PointerRewind, match="not newer"):
        store.move_pointer("run-a", v2, v1)
    with pytest.raises(PointerRewind):
        store.move_pointer("run-a", READ_NOW, v2)
    assert store.read_pointer("run-a") == v2


def test_a_run_starts_at_its_boot_version(store: Store) -> None:
    store.create_run("run-a", boot_version=5)
    with pytest.raises(InvalidVersion, match="boot version 5"):
        write(store, "run-a", 4)
    assert store.version_infos("run-a") == []
    # Another writer put version 4 there anyway: the pointer still refuses to start below 5.
    files = encode_version(random_checkpoint(), None, version=4, base_version=None, codec="full")
    for name, data in files.items():
        store.objects.put(f"run-a/updates/weight_v000004/{name}", data)
    with pytest.raises(PointerRewind, match="boot version 5"):
        store.move_pointer("run-a", None, VersionRef("run-a", 4))
    v5 = write(store, "run-a", 5)
    store.move_pointer("run-a", None, v5)
    assert store.read_pointer("run-a") == v5


def test_a_stale_expectation_is_a_conflict(store: Store) -> None:
    store.create_run("run-a")
    v0, v1, v2 = (write(store, "run-a", v) for v in range(3))
    store.move_pointer("run-a", None, v0)
    store.move_pointer("run-a", v0, v1)
    with pytest.raises(PointerConflict, match="expected run-a/weight_v000000"):
        store.move_pointer("run-a", v0, v2)
    assert store.read_pointer("run-a") == v1


def test_the_pointer_never_names_an_incomplete_version(store: Store) -> None:
    store.create_run("run-a")
    with pytest.raises(VersionNotFound, match="not complete"):
        store.move_pointer("run-a", None, VersionRef("run-a", 3))
    assert store.read_pointer("run-a") is None


def test_the_pointer_only_names_versions_of_its_own_run(store: Store) -> None:
    store.create_run("run-a")
    store.create_run("run-b")
    other = write(store, "run-b", 1)
    with pytest.raises(InvalidName):
        store.move_pointer("run-a", None, other)
    assert store.read_pointer("run-a") is None


def test_a_garbled_pointer_is_reported_not_guessed(store: Store) -> None:
    store.create_run("run-a")
    store.objects.put("run-a/latest", b"run-b/weight_v000003")
    with pytest.raises(CorruptPayload, match="another run"):
        store.read_pointer("run-a")
    store.objects.put("run-a/latest", b"\xffnot a pointer")
    with pytest.raises(CorruptPayload):
        store.read_pointer("run-a")


def test_threads_racing_to_move_the_pointer_exactly_one_wins(store: Store) -> None:
    store.create_run("run-a")
    v0 = write(store, "run-a", 0)
    store.move_pointer("run-a", None, v0)
    candidates = [write(store, "run-a", v, seed=v) for v in range(1, 7)]
    outcomes = race([lambda ref=ref: store.move_pointer("run-a", v0, ref) for ref in candidates])
    assert sorted(outcomes) == ["PointerConflict"] * (len(candidates) - 1) + ["won"]
    assert store.read_pointer("run-a") == candidates[outcomes.index("won")]
