"""Codec instances are shared module-wide; encoding and decoding from many threads is safe."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from store.codecs import get_codec
from store.synthetic import random_checkpoint, small_update


@pytest.mark.parametrize("name", ["xor", "sparse"])
def test_one_codec_instance_encodes_and_applies_from_many_threads(name: str) -> None:
    codec = get_codec(name).delta
    base = random_checkpoint(seed=3)
    target = small_update(base, seed=4)
    pairs = [(n, target[n], base[n]) for n in target] * 8

    def round_trip(item):
        tensor_name, new, old = item
        payload = codec.encode_tensor(new, old)
        out = old.data.copy()
        if payload is not None:
            codec.apply_into(out, payload, new.itemsize, tensor_name)
        return np.array_equal(out, new.data)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(round_trip, pairs))
    assert results and all(results)


def test_tasks_run_large_tensors_alone_and_small_ones_in_fair_batches_largest_first() -> None:
    """Every tensor in exactly one task; a tensor of at least SMALL_BYTES alone; the small
    ones together in their order, no batch above a thread's share unless it holds one
    tensor; tasks ordered by work, largest first."""
    from store.codecs.workers import SMALL_BYTES, TENSOR_OVERHEAD_BYTES, tasks

    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, SMALL_BYTES, 200)]
    sizes[3] = sizes[50] = 8 * SMALL_BYTES
    sizes[120] = SMALL_BYTES

    def work(group: list[int]) -> int:
        return sum(sizes[i] + TENSOR_OVERHEAD_BYTES for i in group)

    for count in (1, 2, 8):
        groups = tasks(sizes, count)
        assert sorted(i for group in groups for i in group) == list(range(len(sizes)))
        assert [work(group) for group in groups] == sorted(map(work, groups), reverse=True)
        share = sum(work([i]) for i in range(len(sizes))) / count
        for group in groups:
            if any(sizes[i] >= SMALL_BYTES for i in group):
                assert len(group) == 1
            else:
                assert group == sorted(group)
                assert len(group) == 1 or work(group) <= share
        batches = [g for g in groups if sizes[g[0]] < SMALL_BYTES]
        assert len(groups) == 3 + len(batches)
        # One thread: one batch; eight: the small ones' work split over several.
        assert (len(batches) == 1) == (count == 1)


def test_batched_small_tensors_encode_to_the_same_bytes_and_fold_back_on_two_threads() -> None:
    """A checkpoint of many small tensors and a few large ones: the delta is byte for byte
    the one-thread delta, progress counts every tensor once, and the fold on two threads
    gives back the target; an error in a batched tensor is raised."""
    from store.codecs import encode_version, fold, workers
    from tests.store.codec_round_trip import encoded_on_one_and_two_threads

    shapes = {f"small.{i}": (64, 33 + i) for i in range(40)}
    shapes |= {"large.a": (1024, 1024), "large.b": (1536, 512)}
    base = random_checkpoint(seed=5, shapes=shapes)
    target = small_update(base, seed=6, fraction=0.01)
    reports: list[tuple[int, int]] = []

    def encode(threads: int) -> dict[str, bytes]:
        reports.clear()
        return encode_version(
            target, base, version=1, base_version=0, codec="sparse", workers=threads,
            progress=lambda done, total, _stage: reports.append((done, total)),
        )  # fmt: skip

    one, two = encoded_on_one_and_two_threads(encode)
    assert one == two
    assert reports[-1] == (42, 42) and [d for d, _ in reports] == sorted(d for d, _ in reports)
    folded = fold(base, [two])
    assert all(np.array_equal(folded[n].data, target[n].data) for n in target)

    def fails_on_one(name: str) -> str:
        if name == "small.7":
            raise ValueError(name)
        return name

    names = list(shapes)
    sizes = [base[n].nbytes for n in names]
    assert workers.map_tensors(str.upper, names, sizes) == [n.upper() for n in names]
    with pytest.raises(ValueError, match=r"small\.7"):
        workers.map_tensors(fails_on_one, names, sizes)
