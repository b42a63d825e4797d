"""Tether's own safetensors writer and reader agree with the reference library, every dtype."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from store.checksum import file_checksum
from store.errors import CorruptPayload, InvalidName
from store.safetensors_io import dump, load, read_header, write_file
from store.tensors import RawTensor
from store.torch_bridge import state_dict_to_raw


def test_dump_matches_the_reference_library_byte_for_byte_for_numpy_dtypes():
    rng = np.random.default_rng(0)
    arrays = {
        "b.u8": rng.integers(0, 255, (3, 5), dtype=np.uint8),
        "a.f32": rng.standard_normal((4, 3)).astype(np.float32),
        "c.f16": rng.standard_normal((7,)).astype(np.float16),
        "d.i64": rng.integers(-9, 9, (2,)).astype(np.int64),
        "e.scalar": np.array(1.5, dtype=np.float64),
        "f.empty": np.zeros((0, 4), dtype=np.int16),
        "g.bool": np.array([True, False, True]),
    }
    dtypes = {"u": "U", "f": "F", "i": "I", "b": "BOOL"}
    raw = {}
    for name, a in arrays.items():
        code = "BOOL" if a.dtype == bool else f"{dtypes[a.dtype.kind]}{8 * a.itemsize}"
        raw[name] = RawTensor(code, a.shape, np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    assert dump(raw) == safetensors.numpy.save(arrays)


def test_dump_matches_the_reference_library_for_bf16_and_fp8():
    sd = {
        "w.bf16": torch.randn(5, 3).to(torch.bfloat16),
        "w.fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "w.f32": torch.randn(2),
    }
    assert dump(state_dict_to_raw(sd)) == safetensors.torch.save(sd)


def test_write_file_writes_dump_s_bytes_and_returns_their_size_and_file_checksum(
    tmp_path: Path,
) -> None:
    sd = {
        "w.bf16": torch.randn(64, 3).to(torch.bfloat16),
        "w.fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "s.scalar": torch.tensor(0.5),
        "z.empty": torch.zeros(0, 2),
    }
    raw = state_dict_to_raw(sd)
    path = tmp_path / "m.safetensors"
    size, digest = write_file(path, raw, {"format": "pt"})
    assert path.read_bytes() == dump(raw, {"format": "pt"})
    assert path.read_bytes() == safetensors.torch.save(sd, metadata={"format": "pt"})
    assert (size, digest) == (path.stat().st_size, file_checksum(path))


def test_write_file_refuses_bad_metadata_before_creating_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(InvalidName, match="metadata must map str to str"):
        write_file(path, {"x": RawTensor("U8", (1,), np.ones(1, np.uint8))}, {"k": 1})  # type: ignore[dict-item]
    assert not path.exists()


def test_load_reads_reference_files_as_zero_copy_views():
    sd = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    blob = safetensors.torch.save(sd, metadata={"k": "v"})
    tensors, metadata = load(blob)
    assert metadata == {"k": "v"}
    assert tensors["x"].dtype == "F32" and tensors["x"].shape == (2, 3)
    assert tensors["x"].data.base is not None
    assert tensors["x"].data.tobytes() == sd["x"].numpy().tobytes()


def test_header_is_padded_so_data_starts_on_an_eight_byte_boundary():
    blob = dump({"abc": RawTensor("U8", (1,), np.ones(1, np.uint8))}, {"m": "x"})
    _, start = read_header(blob)
    assert start % 8 == 0


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:4],
        lambda b: (10**12).to_bytes(8, "little") + b[8:],
        lambda b: b[:8] + b"[" + b[9:],
        lambda b: b + b"\x00",
    ],
    ids=["short", "huge-header", "not-json", "trailing-bytes"],
)
def test_garbled_files_raise_corrupt_payload(mangle):
    blob = dump({"abc": RawTensor("U8", (3,), np.ones(3, np.uint8))})
    with pytest.raises(CorruptPayload):
        load(mangle(blob))
