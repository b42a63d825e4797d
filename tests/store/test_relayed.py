"""A version's claim and index relayed by the control plane: a catch-up planned and verified
from them reads neither from the store, and a copy whose parts disagree is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from store.errors import CorruptPayload
from store.layout import CLAIM_FILENAME, version_file_key
from store.manifest import INDEX_FILENAME
from store.relayed import RelayedVersion
from store.sources import ObjectSource, SourcedFetch
from store.store import Store
from store.types import VersionRef
from tests.store.chain import publish_chain, same_tensors
from tests.store.test_store import ReadsRecorded

RUN = "relayed"


def planning_files(store: Store, ref: VersionRef) -> tuple[bytes, bytes]:
    return (
        store.objects.get(version_file_key(ref, CLAIM_FILENAME)),
        store.objects.get(version_file_key(ref, INDEX_FILENAME)),
    )


def recorded_store(tmp_path: Path) -> tuple[ReadsRecorded, Store]:
    """A folder store whose object reads are recorded."""
    objects = ReadsRecorded(tmp_path / "store")
    return objects, Store(str(tmp_path / "store"), objects=objects)


def test_a_catch_up_with_the_relayed_claim_and_index_reads_neither_from_the_store(
    tmp_path: Path,
) -> None:
    objects, store = recorded_store(tmp_path)
    history = publish_chain(store, RUN, "FDD")
    target = VersionRef(RUN, 2)
    relayed = RelayedVersion.check(target, *planning_files(store, target))
    # A mirror of the store as the pass's one source, so the claim's digests are in use.
    sources = SourcedFetch([ObjectSource.open(str(tmp_path / "store"))])

    objects.read.clear()
    result = store.materialize(
        RUN, 2, base=history[1], have=1, sources=sources, relayed={2: relayed}
    )
    assert same_tensors(result, history[2])
    target_folder = f"{RUN}/updates/weight_v000002/"
    assert [key for key in objects.read if key.startswith(target_folder)] == [], (
        "the target's claim, index and shards come from the relayed copy and the source"
    )
    assert sources.bytes_from.get("objects", 0) > 0
    sources.close()


def test_without_a_relayed_copy_the_catch_up_reads_the_claim_and_index_from_the_store(
    tmp_path: Path,
) -> None:
    objects, store = recorded_store(tmp_path)
    history = publish_chain(store, RUN, "FD")
    objects.read.clear()
    result = store.materialize(RUN, 1, base=history[0], have=0)
    assert same_tensors(result, history[1])
    assert version_file_key(VersionRef(RUN, 1), INDEX_FILENAME) in objects.read


@pytest.mark.parametrize(
    ("damage", "found"),
    [
        ("index byte", "relayed index"),
        ("index of another version", "relayed index"),
        ("claim without the index", "records no"),
        ("claim without a shard", "does not record shards"),
        ("claim not JSON", "not JSON"),
    ],
)
def test_a_relayed_copy_whose_claim_and_index_disagree_is_refused(
    tmp_path: Path, damage: str, found: str
) -> None:
    store = Store(str(tmp_path / "store"))
    publish_chain(store, RUN, "FD")
    ref = VersionRef(RUN, 1)
    claim, index = planning_files(store, ref)
    entries = json.loads(claim)
    if damage == "index byte":
        index = index.replace(b"000001", b"000002", 1)
    elif damage == "index of another version":
        claim, index = planning_files(store, VersionRef(RUN, 0))
        entries = json.loads(claim)
    elif damage == "claim without the index":
        del entries[INDEX_FILENAME]
    elif damage == "claim without a shard":
        for name in [n for n in entries if n.endswith(".safetensors")]:
            del entries[name]
    if damage.startswith("claim without"):
        claim = json.dumps(entries).encode()
    elif damage == "claim not JSON":
        claim = b"{" + claim
    with pytest.raises(CorruptPayload, match=found):
        RelayedVersion.check(ref, claim, index)
