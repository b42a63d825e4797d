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
