"""Folding a chain of versions: one pass per tensor, same result as applying them one by one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.codecs import decode_version, encode_version, fold
from store.errors import ChecksumMismatch, CorruptPayload, TensorMismatch
from store.manifest import INDEX_FILENAME
from store.tensors import RawTensor
from tests.store.tensor_cases import chains, same_bits


def encode_chain(checkpoints, codecs):
    return [
        encode_version(checkpoints[i + 1], checkpoints[i], version=i + 1, base_version=i, codec=c)
        for i, c in enumerate(codecs)
    ]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), length=st.integers(2, 5))
def test_fold_of_a_chain_equals_applying_each_delta_and_equals_the_target(data, length):
    checkpoints = data.draw(chains(length))
    codecs = data.draw(
        st.lists(st.sampled_from(["xor", "sparse"]), min_size=length - 1, max_size=length - 1)
    )
    deltas = encode_chain(checkpoints, codecs)
    one_by_one = checkpoints[0]
    for files in deltas:
        one_by_one = decode_version(files, one_by_one)
    folded = fold(checkpoints[0], deltas)
    assert same_bits(folded, one_by_one)
    assert same_bits(folded, checkpoints[-1])
    for name, tensor in folded.items():
        base = checkpoints[0][name]
        if tensor is base:
            continue
        # A patched tensor says where it may differ from the base it was folded from.
        assert tensor.changed is not None
        positions = tensor.changed.relative_to(base)
        assert positions is not None and np.all(np.diff(positions) > 0)
        differing = np.flatnonzero(tensor.bits() != base.bits())
        assert set(differing.tolist()) <= set(positions.tolist())
        assert tensor.changed.relative_to(RawTensor(base.dtype, base.shape, base.data)) is None


def test_the_changes_a_fold_records_never_keep_its_base_alive():
    import gc
    import weakref

    cps = small_chain(2)
    base = {"a": RawTensor("BF16", (50,), cps[0]["a"].data.copy())}
    folded = fold(base, encode_chain(cps, ["xor"]))
    alive = weakref.ref(base["a"])
    del base
    gc.collect()
    assert alive() is None
    assert folded["a"].changed is not None and folded["a"].changed.base() is None


def small_chain(n: int = 4) -> list[dict[str, RawTensor]]:
    rng = np.random.default_rng(3)
    out = [{"a": RawTensor("BF16", (50,), rng.integers(0, 256, 100, np.uint8))}]
    for _ in range(n - 1):
        data = out[-1]["a"].data.copy()
        data[rng.integers(0, 100, 5)] ^= 2
        out.append({"a": RawTensor("BF16", (50,), data)})
    return out


def test_a_full_version_in_the_chain_restarts_the_fold():
    cps = small_chain(4)
    deltas = encode_chain(cps, ["xor", "sparse", "xor"])
    deltas[1] = encode_version(cps[2], None, version=2, base_version=None, codec="full")
    assert same_bits(fold(cps[0], deltas), cps[3])
    assert same_bits(fold(None, deltas[1:]), cps[3])


def test_a_chain_with_a_gap_is_refused():
    cps = small_chain(4)
    deltas = encode_chain(cps, ["xor", "sparse", "xor"])
    with pytest.raises(CorruptPayload, match="v2"):
        fold(cps[0], [deltas[0], deltas[2]])


def test_a_delta_chain_without_a_base_is_refused():
    cps = small_chain(2)
    with pytest.raises(TensorMismatch, match="base"):
        fold(None, encode_chain(cps, ["sparse"]))


def test_a_corrupt_delta_late_in_the_chain_leaves_the_base_untouched():
    cps = small_chain(4)
    base_copy = cps[0]["a"].data.copy()
    deltas = encode_chain(cps, ["xor", "sparse", "sparse"])
    shard = next(k for k in deltas[2] if k != INDEX_FILENAME)
    bad = bytearray(deltas[2][shard])
    bad[-1] ^= 0xFF
    deltas[2] = {**deltas[2], shard: bytes(bad)}
    with pytest.raises(CorruptPayload):
        fold(cps[0], deltas)
    assert np.array_equal(cps[0]["a"].data, base_copy)


def test_fold_reads_each_file_of_a_lazy_mapping_once():
    from collections.abc import Mapping

    class CountingFiles(Mapping):
        def __init__(self, files):
            self.files, self.reads = files, {}

        def __getitem__(self, key):
            self.reads[key] = self.reads.get(key, 0) + 1
            return self.files[key]

        def __iter__(self):
            return iter(self.files)

        def __len__(self):
            return len(self.files)

    cps = small_chain(3)
    lazy = [CountingFiles(f) for f in encode_chain(cps, ["xor", "sparse"])]
    assert same_bits(fold(cps[0], lazy), cps[2])
    assert all(count == 1 for files in lazy for count in files.reads.values())


def test_folded_tensors_are_aligned_and_independent_of_each_other_and_of_the_base():
    """Folded tensors share one allocation: each still starts aligned for its element type,
    and writing into one changes neither its neighbours nor the base."""
    rng = np.random.default_rng(4)
    shapes = {"a": ("U8", 1, 13), "b": ("F32", 4, 7), "c": ("BF16", 2, 5)}
    base = {
        name: RawTensor(dtype, (n,), rng.integers(0, 256, n * width, dtype=np.uint8))
        for name, (dtype, width, n) in shapes.items()
    }
    target = {name: RawTensor(t.dtype, t.shape, t.data ^ np.uint8(1)) for name, t in base.items()}
    before = {name: t.data.copy() for name, t in base.items()}
    folded = fold(base, [encode_version(target, base, version=1, base_version=0, codec="sparse")])
    assert same_bits(folded, target)
    assert all(t.bits().flags.aligned for t in folded.values())
    folded["b"].data[:] = 0
    assert same_bits({k: folded[k] for k in "ac"}, {k: target[k] for k in "ac"})
    assert all(np.array_equal(base[name].data, before[name]) for name in base)


def test_a_fold_reuses_the_memory_of_a_dropped_fold_but_never_of_one_still_held():
    import gc

    cps = small_chain(3)
    chain = encode_chain(cps, ["sparse", "sparse"])
    first = fold(cps[0], chain[:1])
    address = first["a"].data.ctypes.data
    held = first["a"].data[10:]  # a view of one tensor keeps the whole allocation
    del first
    gc.collect()
    second = fold(cps[0], chain[:1])
    assert second["a"].data.ctypes.data != address
    assert same_bits(second, cps[1])
    del held, second
    gc.collect()
    third = fold(cps[1], chain[1:])
    assert same_bits(third, cps[2])
    # Once dropped, its memory is what the next fold gets: no fresh pages to fault in.
    third_address = third["a"].data.ctypes.data
    del third
    gc.collect()
    assert fold(cps[1], chain[1:])["a"].data.ctypes.data == third_address


LARGE = (1 << 22) * 2 + 3000  # BF16 elements: two full blocks of the sparse codec and a tail


def large_pair() -> tuple[dict[str, RawTensor], dict[str, RawTensor]]:
    """A three-block BF16 tensor and a target with every 1,000th element one unit up."""
    bits = np.random.default_rng(4).integers(0x3000, 0x4000, LARGE, dtype=np.uint16)
    moved = bits.copy()
    moved[::1000] += np.uint16(1)
    return (
        {"w": RawTensor("BF16", (LARGE,), bits.view(np.uint8))},
        {"w": RawTensor("BF16", (LARGE,), moved.view(np.uint8))},
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("codec", ["sparse", "xor"])
def test_a_fold_that_copies_applies_and_hashes_in_one_pass_still_refuses_a_wrong_result(
    codec, threads
):
    """The fold fills the result from the base while it applies and hashes each block as it
    is finished, with no copy or checksum pass of its own. A base that differs from the one
    the delta was encoded against, in one unchanged element of the first block, the middle
    one or the tail after the last change, yields a result whose digest does not match:
    it is refused, so every block (and the bytes copied after the last change) was hashed;
    the right base folds to the target bit for bit, so nothing extra was."""
    from store.codecs import workers

    base, target = large_pair()
    files = encode_version(target, base, version=1, base_version=0, codec=codec)
    before = workers.threads()
    workers.set_threads(threads)
    try:
        assert same_bits(fold(base, [files]), target)
        for element in (1, (1 << 22) + 1, LARGE - 1):
            wrong = base["w"].bits().copy()
            wrong[element] ^= np.uint16(1)
            wrong_base = {"w": RawTensor("BF16", (LARGE,), wrong.view(np.uint8))}
            with pytest.raises(ChecksumMismatch, match="'w'"):
                fold(wrong_base, [files])
    finally:
        workers.set_threads(before)


def test_a_corrupt_block_refuses_the_fold_on_two_threads_and_the_next_fold_still_runs():
    """Blocks hash in order as they finish; a block whose payload is corrupt stops the fold
    with an error, and no block left waiting for it holds a codec thread: the next fold
    on the same threads completes."""
    from store.codecs import workers
    from store.safetensors_io import dump, load

    base, target = large_pair()
    files = encode_version(target, base, version=1, base_version=0, codec="sparse")
    shard = next(name for name in files if name.endswith(".safetensors"))
    tensors, metadata = load(files[shard])
    payload = tensors["w"].data.copy()
    payload[len(payload) // 4 : len(payload) // 4 + 64] ^= 0xFF  # inside the first block
    damaged = {**files, shard: dump({"w": RawTensor("U8", payload.shape, payload)}, metadata)}
    before = workers.threads()
    workers.set_threads(2)
    try:
        with pytest.raises((CorruptPayload, ChecksumMismatch)):
            fold(base, [damaged])
        assert same_bits(fold(base, [files]), target)
    finally:
        workers.set_threads(before)
