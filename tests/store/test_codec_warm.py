"""`store.codecs.warm`: once it has run, folding a catch-up's delta loads no compiled kernel.

Each probe runs in a fresh interpreter (the kernels a process has loaded are per process, and
this one's earlier tests load them), which lists the codec kernels' loaded signatures before
warming, after it, and after encoding and folding a delta shaped like real updates: small
tensors and a large model's (whose blocks the fold fills from the base as it applies them),
folded onto a writable base and onto a read-only one, as an agent loads it. A kernel is
loaded once per argument type, and whether an array is writable is part of its type.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import numpy as np
from store.codecs import class_kernels, decode_version, encode_version, sparse_kernels, sparse_v2
from store.tensors import RawTensor
from tests.fixtures.kernels import loaded_kernels

def loaded():
    return loaded_kernels(class_kernels, sparse_kernels)

before = loaded()
if sys.argv[1] != "cold":
    from store.codecs import warm
    seconds = warm.warm_decoders() if sys.argv[1] == "decoders" else warm.warm()
    assert seconds > 0, seconds
warmed = loaded()
# Updates as a catch-up meets them: an RL step's sparse small moves, denser ones, a few
# large moves, a norm's handful of elements; BF16 weights and F32 tables.
rng = np.random.default_rng(11)
base, target = {}, {}
for dtype, width, size, share, ulps in [
    ("BF16", "<u2", 1 << 18, 0.002, 3), ("BF16", "<u2", 1 << 18, 0.1, 3),
    ("BF16", "<u2", 1 << 17, 0.05, 1 << 12), ("BF16", "<u2", 7, 0.5, 3),
    ("F32", "<u4", 1024, 0.3, 3), ("F32", "<u4", 1 << 16, 0.01, 1 << 20),
]:
    high = 0x3C00 if width == "<u2" else 0x3C000000
    bits = (rng.integers(0, high >> 2, size) + high).astype(width)
    moved = bits + (rng.random(size) < share) * rng.integers(1, ulps + 1, size)
    name = f"{dtype}.{size}.{share}"
    base[name] = RawTensor(dtype, (size,), bits.view(np.uint8))
    target[name] = RawTensor(dtype, (size,), moved.astype(width).view(np.uint8))
# And an optimizer's step, which moves small values and leaves large ones (coded by class).
bits = rng.integers(0x3000, 0x3E00, 1 << 17).astype("<u2")
base["BF16.step"] = RawTensor("BF16", (bits.size,), bits.view(np.uint8))
moved = np.where(bits < 0x3300, bits + 1, bits).astype("<u2")
target["BF16.step"] = RawTensor("BF16", (bits.size,), moved.view(np.uint8))
# Tensors of a large model's size: blocks past `_FILL_MIN_BYTES`, which the fold fills from
# the base as it applies them (by steps, or by class), from a base loaded read-only.
size = 5 << 20
assert 2 * min(size, 1 << sparse_v2.BLOCK_LOG2) >= sparse_v2._FILL_MIN_BYTES
bits = rng.integers(0x3000, 0x3E00, size).astype("<u2")
base["BF16.large"] = RawTensor("BF16", (size,), bits.view(np.uint8))
moved = bits + (rng.random(size) < 0.01) * rng.integers(1, 4, size)
target["BF16.large"] = RawTensor("BF16", (size,), moved.astype("<u2").view(np.uint8))
# A trained weight's values (Gaussian) after an Adam-like step of lr 3e-5 (~2 % change).
values = (rng.standard_normal(size) * 0.02).astype("<f4")
steps = values + 3e-5 * np.sign(rng.standard_normal(size)).astype("<f4")
old_bits, new_bits = ((v.view("<u4") + 0x8000) >> 16 for v in (values, steps))
base["BF16.large_step"] = RawTensor("BF16", (size,), old_bits.astype("<u2").view(np.uint8))
target["BF16.large_step"] = RawTensor("BF16", (size,), new_bits.astype("<u2").view(np.uint8))
files = encode_version(target, base, version=1, base_version=0, codec="sparse")
encoded = loaded()
# Folded onto the base as encoded (writable), then as an agent loads one (read-only).
for writable in (True, False):
    for tensor in base.values():
        tensor.data.flags.writeable = writable
    folded = decode_version(files, base)
    assert all((folded[k].data == target[k].data).all() for k in target)
print(json.dumps({
    "before": sorted(before),
    "warmed": sorted(warmed - before),
    "loaded_by_fold": sorted(loaded() - encoded),
}))
"""


def probe(mode: str) -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("mode", ["decoders", "encoders", "cold"])
def test_after_warm_a_catch_up_s_fold_loads_no_kernel_of_its_own(mode: str) -> None:
    seen = probe(mode)
    assert seen["before"] == [], "importing the codecs alone must load no kernel"
    if mode != "cold":
        assert any("apply_classes" in kernel for kernel in seen["warmed"]), seen["warmed"]
        assert seen["loaded_by_fold"] == [], "kernels the warm-up left to the first fold"
        # What the agent's warm-up saves: it folds a shipped delta and loads no encoder
        # (`change_mask` finds an update's changed words; only an encode calls it).
        encoders = [kernel for kernel in seen["warmed"] if ".change_mask(" in kernel]
        assert (encoders == []) == (mode == "decoders"), seen["warmed"]
    else:
        # The comparison the warm case needs: unwarmed, that same fold loads its decoders.
        assert seen["warmed"] == []
        assert len(seen["loaded_by_fold"]) >= 3, seen["loaded_by_fold"]


def test_the_shipped_delta_is_what_the_codec_writes_today(tmp_path: Path) -> None:
    """The agent folds the shipped files; they must be the current codec's encoding of the
    current cases, or the warm-up loads yesterday's kernels (or fails its checksums)."""
    from store.codecs.warm import SHIPPED, encode_case, shipped_delta, write_shipped

    shipped = shipped_delta()
    assert shipped == encode_case(), (
        f"store/codecs/{SHIPPED}/ is stale: run `python -m store.codecs.warm --write`"
    )
    (tmp_path / "stale.safetensors").write_bytes(b"old")
    written = write_shipped(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(shipped)
    assert {path.name: path.read_bytes() for path in written} == shipped


def test_warm_decoders_fails_on_a_delta_that_no_longer_folds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shipped delta that no longer folds fails the warm-up (the agent logs it and goes
    on) rather than passing silently: a damaged file, or a base regenerated differently
    from the one it was encoded against (whose fold misses the delta's checksums)."""
    from store.codecs import warm
    from store.errors import ChecksumMismatch, CorruptPayload

    shipped = warm.shipped_delta()
    shard = next(name for name in shipped if name.endswith(".safetensors"))
    # The last byte of the data: inside a tensor's coded stream, not in the header.
    damaged = dict(shipped, **{shard: shipped[shard][:-1] + bytes([shipped[shard][-1] ^ 1])})
    monkeypatch.setattr(warm, "shipped_delta", lambda: damaged)
    with pytest.raises(CorruptPayload):
        warm.warm_decoders()
    monkeypatch.undo()

    base, target = warm.warm_case()
    name = "BF16.0.005.2"
    moved = base[name].data.copy()
    moved[0] ^= 1
    monkeypatch.setattr(
        warm, "warm_case", lambda: ({**base, name: replace(base[name], data=moved)}, target)
    )
    with pytest.raises(ChecksumMismatch, match=name):
        warm.warm_decoders()
    monkeypatch.undo()
    assert warm.warm_decoders() > 0
