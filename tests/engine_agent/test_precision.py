"""FP8 block and NVFP4 conversion follow quant-formats.md and are byte-deterministic."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_agent.precision import (
    calibrate_input_scales,
    convert_checkpoint,
    convert_tensors,
    fp8_kernel,
    nvfp4_kernel,
    plan_quantization,
    read_input_scales,
)
from engine_agent.precision.checkpoint import read_config, read_tensors
from engine_agent.precision.fp8 import (
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_fp8_block_torch,
)
from engine_agent.precision.nvfp4 import (
    dequantize_nvfp4,
    e2m1_codes,
    e2m1_values,
    encode_groups,
    global_scale,
    group_amax,
    group_scales,
    pack_nibbles,
    quantize_nvfp4,
    tensor_amax,
)


def weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * 0.02).to(torch.bfloat16)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- FP8 block ---------------------------------------------------------------------------


def test_fp8_blocks_of_an_unaligned_weight_use_ceil_divided_scales_and_bounded_error():
    w = weights(1000, 700).to(torch.float32)
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1000, 700)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (8, 6)
    back = dequantize_fp8_block(q, scale_inv)
    relative = (back - w).norm() / w.norm()
    assert relative < 0.035
    # E4M3 normals carry 3 mantissa bits: per-element error ≤ 2⁻⁴·|x| (plus subnormal slack)
    slack = scale_inv.max() * 2.0**-9
    assert torch.all((back - w).abs() <= w.abs() * 2.0**-4 + slack)


def test_fp8_dequantize_then_requantize_is_bit_identical():
    q, scale_inv = quantize_fp8_block(weights(256, 384))
    q2, scale_inv2 = quantize_fp8_block(dequantize_fp8_block(q, scale_inv))
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(scale_inv, scale_inv2)


def test_fp8_zero_tile_gets_scale_one_and_decodes_to_zero():
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, scale_inv = quantize_fp8_block(w)
    assert scale_inv[0, 0] == 1.0 and scale_inv[0, 1] == pytest.approx(1 / 448)
    assert torch.equal(dequantize_fp8_block(q, scale_inv), w)


# -- NVFP4 ---------------------------------------------------------------------------------


def test_e2m1_rounds_to_nearest_even_and_saturates_at_six():
    y = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.5, -0.1])
    expected = [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, 0.0]
    assert e2m1_values(e2m1_codes(y)).tolist() == expected
    assert e2m1_codes(torch.tensor([-0.1])).item() == 0  # +0, never -0


def test_nibble_order_puts_the_even_element_in_the_low_nibble():
    codes = e2m1_codes(torch.tensor([[0.5, -6.0]]))
    assert pack_nibbles(codes).tolist() == [[0xF1]]


@pytest.mark.parametrize("global_amax", [0.0, 1e-30, 0.05, 6.0, 2688.0, 3e38])
def test_fused_nvfp4_encoding_matches_the_torch_definition_on_every_bf16_value(global_amax):
    # Every BF16 bit pattern (NaN, ±inf, ±0, subnormals, exact E2M1 ties after division),
    # in a shuffled order so that each 16-group mixes magnitudes.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    order = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(7))
    groups = bits[order].view(torch.bfloat16).to(torch.float32).view(-1, 16)
    # Plus groups whose values land exactly on every rounding bound and its neighbours.
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    near = torch.cat(
        [bounds, bounds.nextafter(torch.tensor(9.0)), bounds.nextafter(torch.tensor(0.0))]
    )
    ties = torch.cat([near, -near]).view(-1, 16)
    scale_2 = torch.tensor(global_amax, dtype=torch.float32) / 2688
    scale_2 = torch.where(scale_2 > 0, scale_2, torch.ones_like(scale_2))
    for values in (groups, ties):
        packed, block_scale = encode_groups(values.clone(), scale_2)
        amax = values.abs().amax(dim=-1)
        torch.testing.assert_close(group_amax(values), amax, rtol=0, atol=0, equal_nan=True)
        expected_scale = group_scales(amax, scale_2)
        divisor = expected_scale.to(torch.float32) * scale_2
        reference = e2m1_codes(values.clone().div_(divisor[:, None]).clamp_(-6.0, 6.0))
        assert torch.equal(block_scale.view(torch.uint8), expected_scale.view(torch.uint8))
        assert torch.equal(packed, pack_nibbles(reference))
    # The ties themselves, divided by exactly 1 (a group amax of 6 with a unit global
    # scale gives block scale 1): each bound rounds by its own tie rule.
    packed = encode_groups(ties.clone(), torch.tensor(1.0), torch.full((ties.shape[0],), 6.0))[0]
    assert torch.equal(packed, pack_nibbles(e2m1_codes(ties.clamp(-6.0, 6.0))))


@pytest.mark.parametrize("global_amax", [0.0, 1e-30, 0.05, 6.0, 2688.0, 3e38])
def test_incremental_nvfp4_recoding_without_divisions_matches_the_fused_encoder(global_amax):
    # The incremental recoder codes by comparing magnitudes with per-scale bounds found
    # once by bisection; on every BF16 bit pattern, and on BF16 values at the E2M1 ties
    # (divided by exactly 1), it must write the encoder's bytes.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    order = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(7))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).to(torch.bfloat16)
    tie_bits = torch.cat([ties, -ties]).view(torch.int16)
    cases = [(bits[order], global_amax), (tie_bits, 2688.0)]
    for flat, amax in cases:
        scale_2 = global_scale(amax)
        values = flat.view(torch.bfloat16).to(torch.float32).view(-1, 16)
        expected_codes, expected_scales = encode_groups(values.clone(), scale_2)
        weight = flat.numpy().view(np.uint16)
        # Every group once, some twice (positions are sorted; repeats must not matter).
        positions = np.sort(np.concatenate([np.arange(0, weight.size, 16), [5, weight.size - 1]]))
        packed = np.zeros(weight.size // 2, np.uint8)
        scale_bytes = np.zeros(weight.size // 16, np.uint8)
        bounds = nvfp4_kernel.new_code_bounds()
        update = nvfp4_kernel.recode_groups_in_place(
            weight, positions, float(scale_2), packed, scale_bytes, bounds, -1
        )
        assert update.groups == weight.size // 16
        assert np.array_equal(scale_bytes, expected_scales.view(torch.uint8).numpy())
        assert np.array_equal(packed, expected_codes.reshape(-1).numpy())
        if amax == global_amax:
            table = bounds
    # Column 8 of the table: where each scale byte's run of group amaxes starts. Every
    # magnitude from the least subnormal to inf must fall in the run of its own scale byte,
    # or a group would keep a scale that a full conversion changes.
    magnitudes = torch.arange(1, 0x7F81, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    scale_2 = global_scale(global_amax)
    codes = group_scales(magnitudes.to(torch.float32), scale_2).view(torch.uint8).long().numpy()
    starts = table[:, 8].astype(np.int64)
    bits = np.arange(1, 0x7F81)
    assert np.all((starts[codes] <= bits) & (bits < starts[codes + 1]))


def changed_groups(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Old and new BF16 bits of 4 096 groups of 16 and the sorted positions that differ:
    per group one, a byte's two nibbles, three, or all 16 elements moved an ulp; the group
    max moved up past or down below a scale step, or by an ulp; elements set to NaN, ±inf,
    ±0, ±subnormals, or their sign flipped; old groups holding those values too."""
    rng = np.random.default_rng(seed)
    old = torch.randn(4096 * 16, generator=torch.Generator().manual_seed(seed)) * 0.02
    old_bits = old.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3e-39]
    ).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # fmt: skip
    old_bits[16 * 4000 : 16 * 4008] = 0  # eight all-zero groups (unit scale)
    old_bits[np.arange(4010, 4096) * 16 + 3] = specials[np.arange(86) % specials.size]
    new_bits = old_bits.copy()
    for g in range(4096):
        first = 16 * g
        group = new_bits[first : first + 16]
        top = int(np.argmax(np.where((group & 0x7FFF) > 0x7F80, 0, group & 0x7FFF)))
        kind = g % 9
        if kind == 0:
            picks = rng.choice(16, 1, replace=False)
        elif kind == 1:
            picks = 2 * rng.choice(8, 1) + np.array([0, 1])  # both nibbles of one byte
        elif kind == 2:
            picks = rng.choice(16, 3, replace=False)
        elif kind == 6:
            picks = np.arange(16)
        else:
            picks = np.array([top])
        if kind == 3:  # the group max up past a scale step
            group[top] = bf16_bits(bf16_of(group[top]) * 1.5)
        elif kind == 4:  # the group max down to zero: the amax falls to the next one
            group[top] = group[top] & 0x8000
        elif kind == 5:  # a special value somewhere
            picks = rng.choice(16, 1)
            group[picks] = specials[(g // 9) % specials.size]
        elif kind == 7:  # the group max one ulp up or down, at the max
            group[top] = group[top] + 1 if g % 2 else max(group[top] & 0x7FFF, 1) - 1
        elif kind == 8:  # a sign flip
            group[picks] ^= 0x8000
        else:
            moved = (group[picks] & 0x7FFF).astype(np.int32) + rng.choice([-1, 1], picks.size)
            group[picks] = (group[picks] & 0x8000) | np.clip(moved, 1, 0x7F7F).astype(np.uint16)
    positions = np.flatnonzero(new_bits != old_bits)
    return old_bits, new_bits, positions


def bf16_of(bits: int) -> float:
    return float(np.array([int(bits) << 16], np.uint32).view(np.float32)[0])


def bf16_bits(value: float) -> int:
    return int(torch.tensor([value]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


@pytest.mark.parametrize("seed", [1, 2])
def test_incremental_nvfp4_recoding_writes_the_full_encoders_bytes_whether_or_not_a_scale_moves(
    seed,
):
    # A group whose scale byte stands gets only its changed nibbles rewritten; one whose
    # scale moves is recoded whole. Either way every byte must be the full encoder's, so a
    # single wrong nibble (or a nibble of the neighbour in its byte) fails this.
    old_bits, new_bits, positions = changed_groups(seed)
    # Past the largest finite weight (~0.1): the group scales spread over many E4M3 steps.
    scale_2 = global_scale(0.25)

    def encoded(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32)
        codes, scales = encode_groups(values.view(-1, 16), scale_2)
        return codes.reshape(-1).numpy().copy(), scales.view(torch.uint8).numpy().copy()

    packed, scale_bytes = encoded(old_bits)
    old_scales = scale_bytes.copy()
    expected_packed, expected_scales = encoded(new_bits)
    groups = np.unique(positions >> 4)
    kept = scale_bytes[groups] == expected_scales[groups]
    assert kept.sum() > 1000 and (~kept).sum() > 200, "both paths must be exercised"
    in_changed = (groups[:, None] * 16 + np.arange(16)).reshape(-1)
    magnitudes = new_bits[in_changed] & 0x7FFF
    holder = int(magnitudes[magnitudes < 0x7F80].max())  # the largest finite |x| changed
    update = nvfp4_kernel.recode_groups_in_place(
        new_bits, positions, float(scale_2), packed, scale_bytes,
        nvfp4_kernel.new_code_bounds(), holder,
    )  # fmt: skip
    assert np.array_equal(scale_bytes, expected_scales)
    assert np.array_equal(packed, expected_packed)
    assert update.groups == groups.size
    # Elements at the holder bits are reported where they are their group's max (a NaN
    # or an inf in the group outranks them).
    tops = np.repeat(magnitudes.reshape(-1, 16).max(axis=1), 16)
    holding = in_changed[(magnitudes == holder) & (tops == holder)]
    assert holding.size and np.array_equal(update.new_holders, holding)
    assert np.isnan(update.amax)  # a changed group holds a NaN, and NaN wins
    # Groups that held an inf had scale 448 (their amax may have been the global one).
    assert update.old_scale_was_448 and ((old_scales[groups] & 0x7F) == 0x7E).any()


def test_one_compiled_call_over_many_tensors_writes_what_one_call_per_tensor_writes():
    # A version's step recodes every changed tensor in one call, from a table of array
    # addresses, each row with its own fused group's scale and bounds: every byte, the
    # amax, the 448 flag and the holders must be those of a call per tensor.
    tensors = [changed_groups(seed) for seed in (3, 4, 5)]
    scale_2s = [global_scale(0.25), global_scale(0.25), global_scale(2.0)]
    fused = [0, 0, 1]  # the first two share a fused group's row, the third has its own

    def outputs(bits: np.ndarray, scale_2: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        values = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32)
        codes, scales = encode_groups(values.view(-1, 16), scale_2)
        return codes.reshape(-1).numpy().copy(), scales.view(torch.uint8).numpy().copy()

    # Each row's holder bits: the largest finite changed magnitude of its first tensor.
    changed = [new[p] & 0x7FFF for _, new, p in tensors]
    holder_rows = np.array([int(changed[t][changed[t] < 0x7F80].max()) for t in (0, 2)])
    one_by_one, batched, rows = [], [], []
    for (old_bits, new_bits, positions), scale_2, row in zip(tensors, scale_2s, fused, strict=True):
        packed, scale_bytes = outputs(old_bits, scale_2)
        update = nvfp4_kernel.recode_groups_in_place(
            new_bits, positions, float(scale_2), packed, scale_bytes,
            nvfp4_kernel.new_code_bounds(), int(holder_rows[row]),
        )  # fmt: skip
        one_by_one.append((packed, scale_bytes, update))
        packed, scale_bytes = outputs(old_bits, scale_2)
        batched.append((packed, scale_bytes))
        rows.append(
            (
                new_bits.ctypes.data, new_bits.size, positions.ctypes.data, positions.size,
                packed.ctypes.data, scale_bytes.ctypes.data, row,
            )
        )  # fmt: skip
    table = np.array(rows, np.int64)
    bounds = np.stack([nvfp4_kernel.new_code_bounds() for _ in range(2)])
    scale_2_rows = np.array([float(scale_2s[0]), float(scale_2s[2])], np.float32)
    updates = nvfp4_kernel.recode_tensors_in_place(table, bounds, scale_2_rows, holder_rows)
    for t, ((packed, scale_bytes, update), (got_packed, got_scales)) in enumerate(
        zip(one_by_one, batched, strict=True)
    ):
        assert np.array_equal(got_packed, packed) and np.array_equal(got_scales, scale_bytes)
        assert updates.groups[t] == update.groups
        assert updates.amax[t] == update.amax or (
            np.isnan(updates.amax[t]) and np.isnan(update.amax)
        )
        assert bool(updates.old_scale_was_448[t]) == update.old_scale_was_448
        assert np.array_equal(updates.new_holders(t), update.new_holders)
    assert updates.new_holders(0).size and updates.new_holders(2).size


def fp32_cast_probes() -> torch.Tensor:
    """fp32 values that exercise every branch of an fp32 → E4M3 cast: each BF16 bit pattern
    (NaN, ±inf, ±0, subnormals), and for every exponent and 3-bit mantissa the values at,
    just below and just above each rounding midpoint (ties to even both ways)."""
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    exponents = torch.arange(0, 256, dtype=torch.int64) << 23
    mantissas = torch.arange(0, 8, dtype=torch.int64) << 20
    low = torch.tensor([0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF], dtype=torch.int64)
    grid = (exponents[:, None, None] | mantissas[None, :, None] | low[None, None, :]).reshape(-1)
    grid = torch.cat([grid, grid | (1 << 31)]).to(torch.int64)
    patterns = torch.where(grid >= 2**31, grid - 2**32, grid).to(torch.int32)
    return torch.cat([bf16.to(torch.float32), patterns.view(torch.float32)])


def test_the_compiled_e4m3_cast_is_torchs_cast_on_every_branch():
    # Conversion clamps to ±448 before the cast, so only that range (and NaN) is its domain.
    values = fp32_cast_probes()
    values = values[values.isnan() | (values.abs() <= 448)]
    expected = values.to(torch.float8_e4m3fn).view(torch.uint8)
    found = torch.tensor([int(fp8_kernel.e4m3_code(np.float32(v))) for v in values.numpy()])
    # E4M3 has one NaN per sign: compare NaN as NaN, every other byte exactly.
    nan = values.isnan()
    assert torch.equal(found[~nan], expected[~nan].to(torch.int64))
    assert bool(((found[nan] & 0x7F) == 0x7F).all())
    finite = expected[~nan]
    decoded = torch.tensor([float(fp8_kernel.e4m3_value(np.uint8(c))) for c in finite.tolist()])
    assert torch.equal(decoded, finite.view(torch.float8_e4m3fn).to(torch.float32))


def test_the_branch_free_e4m3_cast_is_torchs_clamp_and_cast_everywhere():
    # The full FP8 pass codes each quotient without branches; beyond ±448 (inf included)
    # it must give what clamping to ±448 and casting gives.
    values = fp32_cast_probes()
    expected = values.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    found = torch.tensor([int(fp8_kernel.e4m3_saturating_code(np.float32(v))) for v in values])
    nan = values.isnan()
    assert torch.equal(found[~nan], expected[~nan].to(torch.int64))
    assert torch.equal(found[nan], expected[nan].to(torch.int64) | 0x7F)


def every_bf16_pattern(finite: bool = False) -> torch.Tensor:
    """Every BF16 bit pattern once (or every finite one), in a fixed shuffled order."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    if finite:
        bits = bits[(bits & 0x7F80) != 0x7F80]
    order = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(7))
    return bits[order].view(torch.bfloat16)


def fp8_tile_cases() -> list[torch.Tensor]:
    """BF16 weights for the full FP8 pass: every bit pattern (NaN tiles, inf tiles), every
    finite one in unaligned shapes, and Gaussian tiles whose amax spans normal to subnormal
    scales, with an inf and a NaN planted in tiles of their own."""
    spread = weights(128 * 6, 320, seed=3).to(torch.float32)
    for row, exponent in enumerate((-140, -126, -40, 0, 40, 120)):
        spread[128 * row : 128 * (row + 1)] *= 2.0**exponent
    spread = spread.to(torch.bfloat16)
    spread[0, 300], spread[200, 5] = float("inf"), float("nan")
    return [
        every_bf16_pattern().view(256, 256),
        every_bf16_pattern(finite=True).view(255, 256),
        every_bf16_pattern(finite=True).view(340, 192),
        spread,
    ]


def test_compiled_full_fp8_conversion_writes_the_torch_ops_bytes():
    for weight in fp8_tile_cases():
        q, scale = quantize_fp8_block(weight)
        expected_q, expected_scale = quantize_fp8_block_torch(weight)
        assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
        assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32))


@pytest.mark.parametrize(
    "global_amax", [0.0, 1e-30, 0.05, 6.0, 2688.0, 3e38, float("inf"), float("nan")]
)
def test_compiled_full_nvfp4_conversion_writes_the_fused_encoders_bytes(global_amax):
    # On every BF16 bit pattern: the compiled pass codes with per-scale bounds instead of a
    # division; a non-finite global scale (an inf or NaN weight) takes the division path.
    # 4,096 groups, then 4,092: the pass finds group amaxes 512 groups at a time.
    for weight in (every_bf16_pattern().view(512, 128), every_bf16_pattern()[:-64].view(-1, 96)):
        packed, block_scale, scale_2 = quantize_nvfp4(weight, global_amax)
        expected_codes, expected_scales = encode_groups(
            weight.to(torch.float32).view(-1, 16), global_scale(global_amax)
        )
        assert torch.equal(scale_2.view(torch.int32), global_scale(global_amax).view(torch.int32))
        assert torch.equal(
            block_scale.view(torch.uint8).reshape(-1), expected_scales.view(torch.uint8)
        )
        assert torch.equal(packed.reshape(-1), expected_codes.reshape(-1))


def test_compiled_full_nvfp4_conversion_of_a_view_starting_at_an_odd_element():
    # The pass reads the bits as uint32 pairs; a weight sliced from a larger buffer at an
    # odd element starts off 4-byte alignment and must still give the fused encoder's bytes.
    storage = every_bf16_pattern(finite=True)
    weight = storage[1 : 1 + 240 * 256].view(240, 256)
    assert weight.is_contiguous() and weight.data_ptr() % 4 == 2
    global_amax = float(weight.float().abs().max())
    packed, block_scale, scale_2 = quantize_nvfp4(weight, global_amax)
    expected_codes, expected_scales = encode_groups(weight.to(torch.float32).view(-1, 16), scale_2)
    assert torch.equal(block_scale.view(torch.uint8).reshape(-1), expected_scales.view(torch.uint8))
    assert torch.equal(packed.reshape(-1), expected_codes.reshape(-1))


def test_bf16_tensor_amax_from_bits_is_the_largest_magnitude_and_nan_wins():
    finite = every_bf16_pattern(finite=True)
    assert tensor_amax(finite) == float(finite.float().abs().max())
    assert tensor_amax(weights(64, 48)) == float(weights(64, 48).float().abs().max())
    assert tensor_amax(torch.zeros(8, 16, dtype=torch.bfloat16)) == 0.0
    with_inf = finite.clone()
    with_inf[3] = -float("inf")
    assert tensor_amax(with_inf) == float("inf")
    assert math.isnan(tensor_amax(every_bf16_pattern()))


def test_nvfp4_group_error_is_bounded_and_requantization_is_bit_identical():
    w = weights(256, 512).to(torch.float32)
    amax = float(w.abs().max())
    packed, block_scale, scale_2 = quantize_nvfp4(w, amax)
    assert packed.dtype == torch.uint8 and packed.shape == (256, 256)
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (256, 32)
    assert scale_2.shape == () and scale_2.item() == pytest.approx(amax / 2688)
    back = dequantize_nvfp4(packed, block_scale, scale_2)
    assert (back - w).norm() / w.norm() < 0.12
    # per element: at most one grid step (≤ 2 units of the block scale for |y| in (4, 6])
    unit = (block_scale.to(torch.float32) * scale_2).repeat_interleave(16, dim=1)
    assert torch.all((back - w).abs() <= unit * 1.0 + 1e-12)
    again = quantize_nvfp4(back, amax)
    assert torch.equal(again[0], packed)
    assert torch.equal(again[1].view(torch.uint8), block_scale.view(torch.uint8))


def test_nvfp4_all_zero_weight_uses_unit_scales():
    packed, block_scale, scale_2 = quantize_nvfp4(torch.zeros(4, 32), 0.0)
    assert scale_2.item() == 1.0
    assert torch.all(block_scale.to(torch.float32) == 1.0)
    assert torch.all(dequantize_nvfp4(packed, block_scale, scale_2) == 0)


# -- checkpoints ---------------------------------------------------------------------------


def test_fp8_checkpoint_keeps_embeddings_norms_and_lm_head_bit_identical(tiny):
    source = read_tensors(tiny.bf16)
    out = read_tensors(tiny.fp8)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], source[name])
    for name in source:
        if "norm" in name:
            assert torch.equal(out[name], source[name])
    q = "model.layers.0.self_attn.k_proj"  # 64 rows: one partial 128-block
    assert out[f"{q}.weight"].dtype == torch.float8_e4m3fn
    assert out[f"{q}.weight_scale_inv"].shape == (1, 1)
    index = json.loads((tiny.fp8 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)


def test_fp8_quantization_config_is_sglangs_block_fp8(tiny):
    quant = read_config(tiny.fp8)["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["fmt"] == "e4m3"
    assert quant["activation_scheme"] == "dynamic"
    assert quant["weight_block_size"] == [128, 128]
    assert "lm_head" in quant["modules_to_not_convert"]
    assert "model.layers.0.input_layernorm" in quant["modules_to_not_convert"]
    assert read_config(tiny.fp8)["torch_dtype"] == "bfloat16"


def test_nvfp4_fused_groups_share_global_and_input_scales(tiny):
    out = read_tensors(tiny.nvfp4)
    for layer in (0, 1):
        base = f"model.layers.{layer}"
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      ("mlp.gate_proj", "mlp.up_proj")):  # fmt: skip
            for suffix in ("weight_scale_2", "input_scale"):
                values = {out[f"{base}.{m}.{suffix}"].item() for m in group}
                assert len(values) == 1, (base, group, suffix, values)
        for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            name = f"{base}.{module}"
            assert out[f"{name}.weight"].dtype == torch.uint8
            assert out[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
            assert out[f"{name}.weight_scale_2"].shape == ()
            assert out[f"{name}.input_scale"].dtype == torch.float32
            assert out[f"{name}.input_scale"].item() > 0


def test_nvfp4_configs_are_modelopt_flat_and_nested(tiny):
    quant = read_config(tiny.nvfp4)["quantization_config"]
    assert quant["quant_method"] == "modelopt" and quant["quant_algo"] == "NVFP4"
    assert quant["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert quant["producer"]["name"] == "modelopt"
    assert "lm_head" in quant["ignore"]
    nested = json.loads((tiny.nvfp4 / "hf_quant_config.json").read_text())
    assert nested["quantization"]["quant_algo"] == "NVFP4"
    assert nested["quantization"]["group_size"] == 16
    assert nested["quantization"]["exclude_modules"] == quant["ignore"]


def test_nvfp4_keeps_a_whole_fused_group_bf16_when_one_member_breaks_k_divisibility():
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 40),
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 40),
        "model.layers.0.self_attn.v_proj.weight": torch.zeros(16, 40),
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(64, 32),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(32, 64),
        "lm_head.weight": torch.zeros(10, 32),
    }
    plan = plan_quantization(shapes, "nvfp4")
    assert plan.groups == (
        ("model.layers.0.mlp.down_proj",),
        ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
    )
    assert "model.layers.0.self_attn.k_proj" in plan.kept_linears
    assert "lm_head" in plan.kept_linears


def test_converting_a_quantized_folder_is_refused(tiny):
    with pytest.raises(ValueError, match="canonical BF16"):
        convert_tensors(read_tensors(tiny.fp8), read_config(tiny.fp8), "nvfp4", {})


def test_nvfp4_without_input_scales_is_refused_by_convert_tensors(tiny):
    with pytest.raises(ValueError, match="input_scale"):
        convert_tensors(read_tensors(tiny.bf16), read_config(tiny.bf16), "nvfp4", None)


def test_conversion_is_byte_identical_across_runs_and_processes(tiny, tmp_path):
    for precision in ("fp8", "nvfp4"):
        convert_checkpoint(tiny.bf16, precision, tmp_path / f"again-{precision}")
    script = (
        "import sys; from engine_agent.precision import convert_checkpoint; "
        "convert_checkpoint(sys.argv[1], 'nvfp4', sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tiny.bf16), str(tmp_path / "process-nvfp4")],
        check=True,
        timeout=120,
    )
    for name in ("model.safetensors", "config.json", "model.safetensors.index.json"):
        assert sha(tmp_path / "again-fp8" / name) == sha(tiny.fp8 / name)
        assert sha(tmp_path / "again-nvfp4" / name) == sha(tiny.nvfp4 / name)
        assert sha(tmp_path / "process-nvfp4" / name) == sha(tiny.nvfp4 / name)


def test_input_scales_from_a_boot_checkpoint_reproduce_its_bytes(tiny, tmp_path):
    scales = read_input_scales(tiny.nvfp4)
    assert len(scales) == 14
    stats = convert_checkpoint(tiny.bf16, "nvfp4", tmp_path / "reused", scales)
    assert stats.input_scales_source == "given"
    assert sha(tmp_path / "reused" / "model.safetensors") == sha(tiny.nvfp4 / "model.safetensors")


def test_calibrated_input_scales_are_powers_of_two_over_2688_for_every_quantized_module(tiny):
    tensors, config = read_tensors(tiny.bf16), read_config(tiny.bf16)
    plan = plan_quantization(tensors, "nvfp4")
    scales = calibrate_input_scales(tensors, config, plan, tiny.bf16)
    assert set(scales) == set(plan.quantized)
    for value in scales.values():
        exponent = torch.log2(torch.tensor(value * 2688.0))
        assert exponent == torch.round(exponent)


def test_a_hashed_folder_write_gives_save_file_s_bytes_and_the_digests_on_disk(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    from engine_agent.precision.checkpoint import (
        INDEX_NAME,
        SHARD_NAME,
        folder_checksums,
        write_safetensors_folder_hashed,
    )

    tensors = {
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 32).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.down_proj.weight_scale_inv": torch.rand(1, 1),
        "model.layers.0.input_layernorm.weight": torch.randn(32).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight_packed": torch.randint(0, 255, (8, 16)).to(
            torch.uint8
        ),
        "model.layers.0.self_attn.q_proj.input_scale": torch.tensor(0.25),
    }
    size, digests = write_safetensors_folder_hashed(tmp_path / "out", tensors)
    # Byte for byte what engines loaded before: the reference writer's layout and metadata.
    reference = tmp_path / "reference.safetensors"
    save_file({n: tensors[n] for n in sorted(tensors)}, str(reference), {"format": "pt"})
    assert (tmp_path / "out" / SHARD_NAME).read_bytes() == reference.read_bytes()
    assert size == reference.stat().st_size
    # The digests hashed while writing are those of the files as written.
    assert digests == folder_checksums(tmp_path / "out")
    assert set(digests) == {SHARD_NAME, INDEX_NAME}
    # And `known` digests are taken as given, the others read.
    (tmp_path / "out" / "config.json").write_text("{}\n")
    both = folder_checksums(tmp_path / "out", known={SHARD_NAME: "given"})
    assert both[SHARD_NAME] == "given" and both[INDEX_NAME] == digests[INDEX_NAME]
    assert set(both) == {SHARD_NAME, INDEX_NAME, "config.json"}
