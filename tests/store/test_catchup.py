"""Catch-up: plans from an anchor or a local base, broken chains, materialization."""

from __future__ import annotations

import pytest

from store.catchup import plan_catch_up
from store.errors import ChecksumMismatch, CorruptPayload, InvalidVersion, VersionNotFound
from store.manifest import INDEX_FILENAME
from store.store import Store
from store.types import VersionKind, VersionRef
from tests.store.chain import publish_chain, same_tensors

# A pure chain for planning: 0 F, 1-3 D, 4 F, 5-6 D.
KINDS = {0: "F", 1: "D", 2: "D", 3: "D", 4: "F", 5: "D", 6: "D"}


def describe(version: int) -> tuple[VersionKind, int | None]:
    if KINDS[version] == "F":
        return VersionKind.FULL, None
    return VersionKind.DELTA, version - 1


def test_plan_starts_at_the_nearest_full_anchor_at_or_below_the_target() -> None:
    plan = plan_catch_up("r", 6, available=KINDS, describe=describe)
    assert (plan.start, plan.from_have, plan.deltas) == (4, False, (5, 6))
    assert plan.downloads == (4, 5, 6)
    assert plan_catch_up("r", 4, available=KINDS, describe=describe).downloads == (4,)
    assert plan_catch_up("r", 3, available=KINDS, describe=describe).downloads == (0, 1, 2, 3)


def test_plan_starts_from_a_local_base_whose_chain_reaches_the_target() -> None:
    plan = plan_catch_up("r", 3, available=KINDS, describe=describe, have=1)
    assert (plan.start, plan.from_have, plan.downloads) == (1, True, (2, 3))
    assert plan_catch_up("r", 6, available=KINDS, describe=describe, have=6).up_to_date


def test_plan_ignores_a_local_base_the_chain_does_not_pass_through() -> None:
    # Version 4 is a FULL anchor, so a base at 2 does not lead to 6; nor does a newer base.
    for have in (2, 7):
        plan = plan_catch_up("r", 6, available=KINDS, describe=describe, have=have)
        assert (plan.start, plan.from_have) == (4, False)


def test_plan_reports_a_broken_chain() -> None:
    available = set(KINDS) - {5}
    with pytest.raises(VersionNotFound, match="version 6 is a delta on version 5"):
        plan_catch_up("r", 6, available=available, describe=describe)
    with pytest.raises(VersionNotFound, match="no complete version 9"):
        plan_catch_up("r", 9, available=KINDS, describe=describe)


def test_a_local_base_bridges_a_gap_in_the_store() -> None:
    available = set(KINDS) - {0, 1}
    plan = plan_catch_up("r", 3, available=available, describe=describe, have=1)
    assert plan.downloads == (2, 3)


def test_store_plans_and_materializes_every_version_bit_for_bit(store: Store) -> None:
    history = publish_chain(store, "run-a", "FDDFDD")
    plan = store.plan_catch_up("run-a", 5)
    assert (plan.start, plan.deltas) == (3, (4, 5))
    for version, tensors in history.items():
        assert same_tensors(store.materialize("run-a", version), tensors)


def test_materialize_from_a_local_base_reads_only_the_deltas_and_leaves_it_untouched(
    store: Store,
) -> None:
    history = publish_chain(store, "run-a", "FDDD")
    base = history[1]
    before = {name: bytes(t.data) for name, t in base.items()}
    steps: list[tuple[int, int, str]] = []
    result = store.materialize(
        "run-a", 3, base=base, have=1, progress=lambda d, t, w: steps.append((d, t, w))
    )
    assert same_tensors(result, history[3])
    assert {name: bytes(t.data) for name, t in base.items()} == before
    assert [step[:2] for step in steps] == [(1, 3), (2, 3), (3, 3)]  # v2, v3, fold


def test_materialize_needs_base_and_have_together(store: Store) -> None:
    history = publish_chain(store, "run-a", "FD")
    with pytest.raises(InvalidVersion, match="together"):
        store.materialize("run-a", 1, base=history[0])


def test_a_corrupted_delta_is_caught_and_the_base_is_left_untouched(store: Store) -> None:
    history = publish_chain(store, "run-a", "FD")
    ref = VersionRef("run-a", 1)
    shard = store.read_manifest(ref).shard_files()[0]
    key = f"run-a/updates/weight_v000001/{shard}"
    payload = bytearray(store.objects.get(key))
    payload[-1] ^= 0xFF
    store.objects.put(key, bytes(payload))
    base = history[0]
    before = {name: bytes(t.data) for name, t in base.items()}
    with pytest.raises((CorruptPayload, ChecksumMismatch)):
        store.materialize("run-a", 1, base=base, have=0)
    assert {name: bytes(t.data) for name, t in base.items()} == before
    report = store.verify(ref)
    assert not report.ok and report.problems


def test_verify_passes_an_intact_chain_and_names_a_missing_shard(store: Store) -> None:
    publish_chain(store, "run-a", "FDD")
    for version in range(3):
        report = store.verify(VersionRef("run-a", version))
        assert report.ok, report.problems
        assert report.tensors_checked > 0 and report.files_checked > 0
    shard = store.read_manifest(VersionRef("run-a", 0)).shard_files()[0]
    assert store.objects.delete(f"run-a/updates/weight_v000000/{shard}")
    report = store.verify(VersionRef("run-a", 0))
    assert report.problems == [f"run-a/weight_v000000/{shard}: missing"]
    assert INDEX_FILENAME not in report.problems[0]


def test_verify_reports_a_full_tensor_whose_bytes_changed(store: Store) -> None:
    publish_chain(store, "run-a", "F")
    ref = VersionRef("run-a", 0)
    files = store.open_version(ref)
    shard = store.read_manifest(ref).shard_files()[0]
    header = files.header(shard)
    name = next(k for k in header if k != "__metadata__")
    data = bytearray(files[shard])
    data_start = 8 + int.from_bytes(data[:8], "little")
    data[data_start + header[name]["data_offsets"][0]] ^= 0x01
    store.objects.put(f"run-a/updates/weight_v000000/{shard}", bytes(data))
    report = store.verify(ref)
    assert not report.ok
    assert any(name in problem for problem in report.problems)
