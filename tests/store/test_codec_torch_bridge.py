"""torch <-> RawTensor conversions keep every bit (NaN payloads, -0.0, FP8 codes)."""

from __future__ import annotations

import pytest
import torch

from store.codecs import decode_version, encode_version
from store.torch_bridge import raw_to_state_dict, state_dict_to_raw, to_raw, to_torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All bit patterns of a 1- or 2-byte dtype (a sample for wider ones), as that dtype."""
    size = torch.empty(0, dtype=dtype).element_size()
    if size == 1:
        return torch.arange(256, dtype=torch.uint8).view(dtype)
    if size == 2:
        return torch.arange(-(2**15), 2**15, dtype=torch.int16).view(dtype)
    return torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32).view(dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_bit_pattern_survives_torch_to_raw_and_back(dtype):
    t = every_pattern(dtype)
    assert bits_equal(to_torch(to_raw(t)), t)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3, 4)])
def test_scalars_and_empty_tensors_keep_their_shape(shape):
    t = torch.ones(shape, dtype=torch.bfloat16)
    raw = to_raw(t)
    assert raw.shape == shape and raw.dtype == "BF16"
    assert bits_equal(to_torch(raw), t)


def test_a_state_dict_survives_a_sparse_delta_bit_for_bit():
    base = {str(i): every_pattern(d) for i, d in enumerate(DTYPES)}
    target = {k: v.view(torch.uint8).flip(0).view(v.dtype) for k, v in base.items()}
    files = encode_version(
        state_dict_to_raw(target),
        state_dict_to_raw(base),
        version=1,
        base_version=0,
        codec="sparse",
    )
    decoded = raw_to_state_dict(decode_version(files, state_dict_to_raw(base)))
    assert all(bits_equal(decoded[k], target[k]) for k in target)


def test_to_raw_copies_unless_told_not_to():
    t = torch.zeros(4, dtype=torch.float32)
    copied, shared = to_raw(t), to_raw(t, copy=False)
    t += 1
    assert copied.data.sum() == 0
    assert shared.data.sum() > 0
