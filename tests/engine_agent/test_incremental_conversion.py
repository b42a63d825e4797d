"""Incremental FP8/NVFP4 conversion writes exactly the bytes a full conversion writes.

Each property draws a chain of updates to a small Qwen3-shaped checkpoint (tiles cut by
the tensor edge included), converts every version incrementally from the previous one and
compares every tensor, scale and config file with a full conversion of the same tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_agent.precision import convert_tensors, plan_quantization
from engine_agent.precision.incremental import IncrementalConverter, changed_positions

HIDDEN = 160  # not a multiple of 128: FP8 tiles cut by the edge; a multiple of 16 for NVFP4
SHAPES = {
    "model.embed_tokens.weight": (96, HIDDEN),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.layers.0.self_attn.q_proj.weight": (256, HIDDEN),
    "model.layers.0.self_attn.k_proj.weight": (64, HIDDEN),
    "model.layers.0.self_attn.v_proj.weight": (64, HIDDEN),
    "model.layers.0.self_attn.o_proj.weight": (HIDDEN, 256),
    "model.layers.0.mlp.gate_proj.weight": (288, HIDDEN),
    "model.layers.0.mlp.up_proj.weight": (288, HIDDEN),
    "model.layers.0.mlp.down_proj.weight": (HIDDEN, 288),
    "model.norm.weight": (HIDDEN,),
    "lm_head.weight": (96, HIDDEN),
}
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": HIDDEN, "vocab_size": 96}
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
LINEARS = [n for n in SHAPES if "proj" in n]


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in SHAPES.items()
    }


def input_scales() -> dict[str, float]:
    plan = plan_quantization(checkpoint(), "nvfp4")
    return dict.fromkeys(plan.quantized, 0.5)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


def assert_identical_to_full(converter_out, tensors, precision, scales) -> None:
    out, config, extra, _ = converter_out
    full, full_config, full_extra = convert_tensors(tensors, CONFIG, precision, scales)
    assert sorted(out) == sorted(full)
    different = [n for n in full if not same_bytes(out[n], full[n])]
    assert not different, f"incremental differs from full in {different}"
    assert config == full_config
    assert extra == full_extra


def diff(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    changes = {}
    for name in new:
        old_bits = old[name].view(-1).view(torch.int16).numpy()
        positions = changed_positions(old_bits, new[name].view(-1).view(torch.int16).numpy())
        if positions.size:
            changes[name] = positions
    return changes


# -- updates -----------------------------------------------------------------------------

KINDS = ("random", "tile_max_down", "tile_max_up", "sign_flip", "zero", "extreme", "global_max")


def apply_update(
    tensors: dict[str, torch.Tensor], kind: str, name: str, count: int, rng: np.random.Generator
) -> None:
    """Change `count` elements of `tensors[name]` in place, the way `kind` says."""
    flat = tensors[name].view(-1)
    values = flat.to(torch.float32)
    n = flat.numel()
    if kind == "random":
        idx = torch.from_numpy(rng.choice(n, size=min(count, n), replace=False))
        flat[idx] = (values[idx] + torch.from_numpy(rng.normal(0, 1e-3, len(idx))).float()).to(
            torch.bfloat16
        )
    elif kind in ("tile_max_down", "tile_max_up", "sign_flip"):
        # The largest elements: FP8 tile and NVFP4 group maxima live among them.
        idx = torch.topk(values.abs(), min(count, n)).indices
        factor = {"tile_max_down": 0.25, "tile_max_up": 3.0, "sign_flip": -1.0}[kind]
        flat[idx] = (values[idx] * factor).to(torch.bfloat16)
    elif kind == "zero":
        idx = torch.from_numpy(rng.choice(n, size=min(count, n), replace=False))
        signs = torch.from_numpy(rng.choice([1.0, -1.0], size=len(idx))).float()
        flat[idx] = (signs * 0.0).to(torch.bfloat16)  # +0 and -0
    elif kind == "extreme":
        idx = torch.from_numpy(rng.choice(n, size=min(count, n), replace=False))
        choices = [BF16_MAX, -BF16_MAX, 1e-40, -1e-40, 1e30, 6e-39, 448.0, 2688.0]
        picked = torch.tensor([choices[i] for i in rng.integers(0, len(choices), len(idx))])
        flat[idx] = picked.to(torch.bfloat16)
    elif kind == "global_max":
        idx = values.abs().argmax().reshape(1)
        flat[idx] = (values[idx] * float(rng.choice([0.1, 1.5, -1.0]))).to(torch.bfloat16)
    else:
        raise AssertionError(kind)


update = st.tuples(
    st.sampled_from(KINDS),
    st.sampled_from([*LINEARS, "model.norm.weight", "lm_head.weight"]),
    st.integers(min_value=1, max_value=40),
)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=st.lists(st.lists(update, min_size=1, max_size=4), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_incremental_conversion_is_bit_identical_to_full_over_a_chain_of_updates(
    precision: str, chain: list, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    scales = input_scales() if precision == "nvfp4" else None
    converter = IncrementalConverter(precision)
    tensors = checkpoint(seed)
    first = converter.convert(tensors, CONFIG, None, scales)
    assert first[3].full
    assert_identical_to_full(first, tensors, precision, scales)
    for step in chain:
        new = {name: t.clone() for name, t in tensors.items()}
        for kind, name, count in step:
            apply_update(new, kind, name, count, rng)
        result = converter.convert(new, CONFIG, diff(tensors, new), scales)
        assert_identical_to_full(result, new, precision, scales)
        tensors = new


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_a_tensor_holding_inf_converts_like_a_full_conversion_when_it_changes_again(
    precision: str,
) -> None:
    # Found by the chain property: once an inf makes the fused group's global scale inf,
    # the full conversion codes every element from inf/inf, so no incremental rule holds.
    scales = input_scales() if precision == "nvfp4" else None
    converter = IncrementalConverter(precision)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = checkpoint()
    tensors[name].view(-1)[100] = BF16_MAX
    tensors[name].view(-1)[5000] = float("inf")
    converter.convert(tensors, CONFIG, None, scales)
    new = {n: t.clone() for n, t in tensors.items()}
    new[name].view(-1)[100] = float("inf")
    new[name].view(-1)[101] = 0.01
    result = converter.convert(new, CONFIG, diff(tensors, new), scales)
    assert_identical_to_full(result, new, precision, scales)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_a_sparse_update_is_converted_incrementally(precision: str) -> None:
    scales = input_scales() if precision == "nvfp4" else None
    converter = IncrementalConverter(precision)
    tensors = checkpoint()
    converter.convert(tensors, CONFIG, None, scales)
    new = {name: t.clone() for name, t in tensors.items()}
    rng = np.random.default_rng(1)
    apply_update(new, "random", "model.layers.0.mlp.down_proj.weight", 30, rng)
    result = converter.convert(new, CONFIG, diff(tensors, new), scales)
    assert not result[3].full
    assert result[3].tensors_changed == 1 and result[3].groups_converted_in_full == 0
    assert_identical_to_full(result, new, precision, scales)


def test_raising_the_global_amax_of_a_fused_group_converts_the_group_in_full() -> None:
    scales = input_scales()
    converter = IncrementalConverter("nvfp4")
    tensors = checkpoint()
    converter.convert(tensors, CONFIG, None, scales)
    new = {name: t.clone() for name, t in tensors.items()}
    new["model.layers.0.self_attn.k_proj.weight"][3, 5] = 1.0  # far above every q/k/v value
    result = converter.convert(new, CONFIG, diff(tensors, new), scales)
    assert result[3].groups_converted_in_full == 1
    q_scale = result[0]["model.layers.0.self_attn.q_proj.weight_scale_2"]
    assert float(q_scale) == pytest.approx(1.0 / 2688)  # q follows k's new amax
    assert_identical_to_full(result, new, "nvfp4", scales)


def test_positions_that_did_not_change_are_harmless() -> None:
    # A fold may report the union of several deltas' positions, some of them reverted.
    converter = IncrementalConverter("fp8")
    tensors = checkpoint()
    converter.convert(tensors, CONFIG, None)
    name = "model.layers.0.self_attn.o_proj.weight"
    superset = {name: np.arange(0, tensors[name].numel(), 7, dtype=np.int64)}
    result = converter.convert(tensors, CONFIG, superset)
    assert not result[3].full
    assert_identical_to_full(result, tensors, "fp8", None)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda c, t, s: (t, CONFIG, None, s), "changed positions unknown"),
        (lambda c, t, s: (t, {**CONFIG, "vocab_size": 97}, {}, s), "config changed"),
        (
            lambda c, t, s: ({**t, "extra.weight": torch.zeros(2)}, CONFIG, {}, s),
            "tensor names, dtypes or shapes changed",
        ),
    ],
)
def test_conversion_falls_back_to_full_when_the_state_cannot_be_trusted(mutate, reason) -> None:
    converter = IncrementalConverter("fp8")
    tensors = checkpoint()
    assert converter.convert(tensors, CONFIG, {}, None)[3].reason == "no previous version converted"
    result = converter.convert(*mutate(converter, tensors, None))
    assert result[3].full and result[3].reason == reason


def test_a_failed_conversion_leaves_no_state_so_the_next_one_is_full() -> None:
    converter = IncrementalConverter("fp8")
    tensors = checkpoint()
    converter.convert(tensors, CONFIG, None)
    bogus = {"model.layers.0.self_attn.q_proj.weight": np.array([10**9], dtype=np.int64)}
    with pytest.raises(IndexError):
        converter.convert(tensors, CONFIG, bogus)
    assert not converter.has_state
    assert converter.convert(tensors, CONFIG, {})[3].full


def test_changed_positions_finds_every_differing_element_including_signed_zeros() -> None:
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, size=1003, dtype=np.uint16)  # not a multiple of 4 elements
    new = old.copy()
    picked = np.array([0, 3, 4, 500, 999, 1000, 1002])
    new[picked] ^= 0x8000  # a sign flip, +0 ↔ -0 included
    assert changed_positions(old, new).tolist() == picked.tolist()
    assert changed_positions(old, old).size == 0


# -- the stager --------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_staged_folders_of_incremental_and_full_conversion_have_the_same_checksums(
    tiny, tmp_path, precision: str, caplog
) -> None:
    from bench.refit import training_step
    from engine_agent.precision.checkpoint import folder_checksums, read_tensors
    from engine_agent.staging import Stager
    from store.torch_bridge import state_dict_to_raw

    v0 = state_dict_to_raw(read_tensors(tiny.bf16))
    v1 = training_step(v0, seed=1, fraction=0.01)
    # Untouched tensors arrive as the same objects, as the fold returns them.
    v1 = {name: v0[name] if name.endswith("norm.weight") else t for name, t in v1.items()}
    following = Stager(tmp_path / "following", precision, tiny.bf16)
    following.stage(0, v0)
    with caplog.at_level("INFO", logger="engine_agent.staging"):
        incremental = following.stage(1, v1)
    fresh = Stager(tmp_path / "fresh", precision, tiny.bf16, incremental=False)
    full = fresh.stage(1, v1)
    assert incremental.conversion == "incremental"
    assert full.conversion.startswith("full")
    assert incremental.checksums == full.checksums == folder_checksums(full.path)
    assert set(incremental.checksums) >= {"model.safetensors", "config.json"}
    # The log line proves identity without the folders at hand.
    assert incremental.checksums["model.safetensors"] in caplog.text


def test_a_stager_without_incremental_conversion_converts_every_version_in_full(
    tiny, tmp_path
) -> None:
    from bench.refit import training_step
    from engine_agent.precision.checkpoint import read_tensors
    from engine_agent.staging import Stager
    from store.torch_bridge import state_dict_to_raw

    v0 = state_dict_to_raw(read_tensors(tiny.bf16))
    stager = Stager(tmp_path, "fp8", tiny.bf16, incremental=False)
    stager.stage(0, v0)
    assert stager.stage(1, training_step(v0, seed=1, fraction=0.01)).conversion.startswith("full")


# -- positions from the fold, the amax holders, the torch fallback -----------------------


def raw(tensors: dict[str, torch.Tensor]) -> dict:
    from store.torch_bridge import to_raw

    return {name: to_raw(t) for name, t in tensors.items()}


@pytest.mark.parametrize("codec", ["xor", "sparse"])
@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_the_version_converter_takes_changed_positions_from_the_fold_not_a_diff(
    precision: str, codec: str
) -> None:
    from engine_agent.precision.incremental import VersionConverter
    from store.codecs import encode_version, fold

    scales = input_scales() if precision == "nvfp4" else None
    rng = np.random.default_rng(4)
    v0 = checkpoint()
    v1 = {name: t.clone() for name, t in v0.items()}
    apply_update(v1, "random", "model.layers.0.mlp.up_proj.weight", 40, rng)
    apply_update(v1, "global_max", "model.layers.0.self_attn.q_proj.weight", 1, rng)
    v2 = {name: t.clone() for name, t in v1.items()}
    apply_update(v2, "tile_max_down", "model.layers.0.mlp.down_proj.weight", 3, rng)
    raw0, raw1, raw2 = raw(v0), raw(v1), raw(v2)
    deltas = [
        encode_version(raw1, raw0, version=1, base_version=0, codec=codec),
        encode_version(raw2, raw1, version=2, base_version=1, codec=codec),
    ]
    converter = VersionConverter(precision)
    converter.convert(raw0, CONFIG, scales)
    folded = fold(raw0, deltas[:1])
    result = converter.convert(folded, CONFIG, scales)
    assert not result[3].full and converter.positions_from_fold == 2
    assert_identical_to_full(result, v1, precision, scales)
    # A chain folded in one pass reports the union of its deltas' positions.
    converter = VersionConverter(precision)
    converter.convert(raw0, CONFIG, scales)
    result = converter.convert(fold(raw0, deltas), CONFIG, scales)
    assert not result[3].full and converter.positions_from_fold == 3
    assert_identical_to_full(result, v2, precision, scales)


def test_positions_folded_against_another_copy_of_the_base_are_not_trusted() -> None:
    from engine_agent.precision.incremental import VersionConverter
    from store.codecs import encode_version, fold

    rng = np.random.default_rng(5)
    v0 = checkpoint()
    v1 = {name: t.clone() for name, t in v0.items()}
    apply_update(v1, "random", "model.layers.0.mlp.up_proj.weight", 40, rng)
    converter = VersionConverter("fp8")
    converter.convert(raw(v0), CONFIG)
    # Folded from equal bytes, but not from the tensors the converter converted last.
    delta = encode_version(raw(v1), raw(v0), version=1, base_version=0, codec="xor")
    result = converter.convert(fold(raw(v0), [delta]), CONFIG)
    assert not result[3].full and converter.positions_from_fold == 0
    assert_identical_to_full(result, v1, "fp8", None)


@pytest.mark.parametrize("ties_changed", [1, 2])
def test_a_global_amax_held_twice_survives_one_holder_moving_down(ties_changed: int) -> None:
    scales = input_scales()
    tensors = checkpoint()
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    tensors[q][7, 9] = 0.5  # the fused q/k/v group's amax, held by two elements
    tensors[k][2, 130] = -0.5
    converter = IncrementalConverter("nvfp4")
    converter.convert(tensors, CONFIG, None, scales)
    new = {name: t.clone() for name, t in tensors.items()}
    new[q][7, 9] = 0.25
    if ties_changed == 2:
        new[k][2, 130] = 0.125
    result = converter.convert(new, CONFIG, diff(tensors, new), scales)
    # With one holder left the amax stands; with none it fell and the group is redone.
    assert result[3].groups_converted_in_full == ties_changed - 1
    assert_identical_to_full(result, new, "nvfp4", scales)
    # And a change that lands exactly on the amax becomes a holder itself.
    newer = {name: t.clone() for name, t in new.items()}
    newer[q][0, 0] = 0.5 if ties_changed == 1 else 0.125
    newer[k][2, 130] = 0.0
    result = converter.convert(newer, CONFIG, diff(new, newer), scales)
    assert result[3].groups_converted_in_full == 0
    assert_identical_to_full(result, newer, "nvfp4", scales)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_without_the_compiled_kernels_the_torch_path_writes_the_same_bytes(
    precision: str, monkeypatch
) -> None:
    from engine_agent.precision import incremental

    monkeypatch.setattr(incremental, "_fp8_kernel", None)
    monkeypatch.setattr(incremental, "_nvfp4_kernel", None)
    scales = input_scales() if precision == "nvfp4" else None
    rng = np.random.default_rng(6)
    converter = IncrementalConverter(precision)
    tensors = checkpoint()
    converter.convert(tensors, CONFIG, None, scales)
    for kind in KINDS:
        new = {name: t.clone() for name, t in tensors.items()}
        apply_update(new, kind, "model.layers.0.mlp.gate_proj.weight", 12, rng)
        result = converter.convert(new, CONFIG, diff(tensors, new), scales)
        assert not result[3].full
        assert_identical_to_full(result, new, precision, scales)
        tensors = new


def test_an_fp8_tile_whose_amax_stands_keeps_its_scale_and_recodes_only_the_changes() -> None:
    # Two elements of a tile hold its amax (both code ±448); one moves down. The tile is
    # suspect, its amax is measured again, found unchanged, and only the change is recoded.
    name = "model.layers.0.mlp.down_proj.weight"
    tensors = checkpoint()
    tensors[name][3, 5] = 0.25
    tensors[name][70, 100] = -0.25
    converter = IncrementalConverter("fp8")
    converter.convert(tensors, CONFIG, None)
    new = {n: t.clone() for n, t in tensors.items()}
    new[name][3, 5] = 0.125
    result = converter.convert(new, CONFIG, diff(tensors, new))
    assert result[3].tiles_requantized == 0
    assert_identical_to_full(result, new, "fp8", None)
    # When the last holder moves down too, the amax falls and the tile is redone whole.
    newer = {n: t.clone() for n, t in new.items()}
    newer[name][70, 100] = 0.0
    result = converter.convert(newer, CONFIG, diff(new, newer))
    assert result[3].tiles_requantized == 1
    assert_identical_to_full(result, newer, "fp8", None)
