"""The store's `VersionEncoder`: the next version of a run is FULL or DELTA by the anchor
policy, the same bytes however many threads encode it, and the base moves only on accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.anchor import AnchorPolicy
from store.codecs import decode_version
from store.encoder import VersionEncoder
from store.store import Store
from store.synthetic import random_checkpoint, small_update
from store.types import VersionKind, VersionRef

FULL, DELTA = VersionKind.FULL, VersionKind.DELTA


def chain(count: int, seed: int = 0) -> list[dict]:
    versions = [random_checkpoint(seed=seed)]
    for step in range(1, count):
        versions.append(small_update(versions[-1], seed=seed + step, fraction=0.03))
    return versions


def test_the_first_version_is_full_then_deltas_until_the_anchor_interval() -> None:
    encoder = VersionEncoder("sparse", AnchorPolicy(every=3), workers=2)
    kinds = []
    for version, tensors in enumerate(chain(7)):
        encoded = encoder.encode(tensors, version)
        encoder.accept(encoded)
        kinds.append(encoded.kind)
    assert kinds == [FULL, DELTA, DELTA, FULL, DELTA, DELTA, FULL]


def test_a_delta_decodes_to_the_target_and_names_its_base() -> None:
    v0, v1 = chain(2)
    encoder = VersionEncoder("xor")
    encoder.accept(encoder.encode(v0, 0))
    encoded = encoder.encode(v1, 1)
    assert (encoded.kind, encoded.base_version) == (DELTA, 0)
    differing = sum(bytes(t.data) != bytes(v0[n].data) for n, t in v1.items())
    assert encoded.changed_tensors == differing > 0
    decoded = decode_version(encoded.files, v0)
    assert all(bytes(decoded[n].data) == bytes(t.data) for n, t in v1.items())


@pytest.mark.parametrize("codec", ["sparse", "xor"])
def test_parallel_encoding_writes_the_same_bytes_as_one_thread(codec: str) -> None:
    v0, v1 = chain(2, seed=5)
    files = []
    for workers in (1, 4):
        encoder = VersionEncoder(codec, workers=workers)
        encoder.accept(encoder.encode(v0, 0))
        files.append(encoder.encode(v1, 1).files)
    assert files[0] == files[1]


def test_nothing_changes_until_the_encoded_version_is_accepted() -> None:
    v0, v1 = chain(2)
    encoder = VersionEncoder()
    first = encoder.encode(v0, 0)
    assert encoder.base is None and encoder.base_version is None
    encoder.accept(first)
    encoder.encode(v1, 1)  # e.g. its upload then fails
    assert encoder.base is v0 and encoder.base_version == 0 and encoder.last_anchor == 0


def test_a_delta_not_much_smaller_than_the_checkpoint_is_published_full() -> None:
    v0 = random_checkpoint(seed=1)
    v1 = random_checkpoint(seed=2)  # every value changed: a delta saves nothing
    encoder = VersionEncoder("sparse", AnchorPolicy(every=100))
    encoder.accept(encoder.encode(v0, 0))
    encoded = encoder.encode(v1, 1)
    assert encoded.kind is FULL and encoded.base_version is None
    assert encoded.changed_tensors == len(v1)


def test_a_resumed_encoder_continues_from_the_stores_version_and_anchor(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    store.create_run("r")
    writer = VersionEncoder("sparse", AnchorPolicy(every=3))
    versions = chain(5)
    for version, tensors in enumerate(versions):
        encoded = writer.encode(tensors, version)
        store.publish(VersionRef("r", version), encoded.files)
        writer.accept(encoded)
    resumed = VersionEncoder("sparse", AnchorPolicy(every=3))
    resumed.resume(store, "r", 4)
    assert (resumed.base_version, resumed.last_anchor) == (4, writer.last_anchor) == (4, 3)
    assert all(bytes(resumed.base[n].data) == bytes(t.data) for n, t in versions[4].items())
    nxt = small_update(versions[4], seed=99)
    assert resumed.encode(nxt, 5).files == writer.encode(nxt, 5).files
