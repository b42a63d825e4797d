"""NVFP4 in NVIDIA ModelOpt layout: E2M1 codes, FP8 per-16 scales, FP32 global scale.

Owns the quantize/dequantize math for one 2-D weight given its (possibly group-shared)
`global_amax`:

- `weight_scale_2 = global_amax / (6 · 448)` (1.0 for an all-zero group);
- per 16-element block along K: `s = block_amax / (6 · weight_scale_2)`, 1.0 for a zero
  block, clamped to [2⁻⁹, 448] and cast to float8_e4m3fn;
- values are divided by the *quantized* block scale times `weight_scale_2`, saturated at
  ±6 and rounded to nearest-even on the E2M1 grid;
- codes are packed two per byte, element 2i in the low nibble (so (0.5, −6) → 0xF1).

A BF16 weight's full conversion runs as one compiled pass over its bits
(`nvfp4_kernel.quantize_full`: group amax, scale and coding fused, no division per element);
`encode_groups` (and the torch ops behind it) stays the definition the tests hold it to.

Must never choose the global amax itself: fused groups share it, and that is decided by
`engine_agent.precision.plan`.
"""

from __future__ import annotations

import math

import torch

from engine_agent.precision.compiled import bf16_bits, compiled_kernel

_kernel = compiled_kernel("nvfp4_kernel", "NVFP4 encoding runs as torch ops, about 5x slower")

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Magnitudes above a bound move to the next code; ties at 0.25/1.25/2.5/5 stay down and ties
# at 0.75/1.75/3.5 go up, which is round-to-nearest-even on this grid.
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
           (5.0, False))  # fmt: skip
_ELEMENTS_PER_STEP = 1 << 20


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) of fp32 values, nearest-even, saturating at ±6.

    The readable definition of the rounding; conversion runs `nvfp4_kernel`'s fused copy
    of it, which the tests hold to this one bit for bit.
    """
    mag = y.abs()
    # Each comparison lands in one reused bool buffer, added as uint8: no per-bound tensors.
    hit = torch.empty_like(mag, dtype=torch.bool)
    hit_u8 = hit.view(torch.uint8)
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for bound, ties_up in _BOUNDS:
        (torch.ge if ties_up else torch.gt)(mag, bound, out=hit)
        code.add_(hit_u8)
    # Negative with a non-zero code is exactly y < -0.25 (zeros keep the + sign).
    torch.lt(y, -_BOUNDS[0][0], out=hit)
    return code.bitwise_or_(hit_u8 << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit codes."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """`[N, K]` codes → `[N, K/2]` bytes, even element in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[N, K/2]` bytes → `[N, K]` codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def global_scale(global_amax: float) -> torch.Tensor:
    """`weight_scale_2` (or `input_scale`) for an amax: amax / 2688, 1.0 when amax is 0."""
    amax = torch.tensor(global_amax, dtype=torch.float32)
    if amax.item() <= 0:
        return torch.tensor(1.0, dtype=torch.float32)
    return amax / (E2M1_MAX * E4M3_MAX)


def tensor_amax(weight: torch.Tensor) -> float:
    """max |x| of a tensor (0.0 when empty), without materialising |x|."""
    if weight.numel() == 0:
        return 0.0
    if _kernel is not None and weight.dtype == torch.bfloat16:
        bits = bf16_bits(weight)
        return float(_kernel.tensor_amax_bits(bits))
    return max(float(weight.max()), -float(weight.min()))


def group_scales(group_amax: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """E4M3 per-16 scales for fp32 group amaxes: amax/(6·scale_2), 1.0 for a zero group."""
    ideal = group_amax / (E2M1_MAX * scale_2)
    ideal = torch.where(group_amax > 0, ideal, torch.ones_like(ideal))
    return ideal.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)


def group_amax(groups: torch.Tensor) -> torch.Tensor:
    """max |x| (fp32 `[G]`) of fp32 16-element groups `[G, 16]`."""
    if _kernel is None:
        return groups.abs().amax(dim=-1)
    return torch.from_numpy(_kernel.group_amax(groups.numpy()))


def encode_groups(
    groups: torch.Tensor, scale_2: torch.Tensor, group_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes `[G, 8]` and E4M3 scales `[G]` of fp32 16-element groups `[G, 16]`.

    The one place values meet scales, shared by full and incremental conversion so that
    both run the same fp32 operations. `group_amax` (max |x| per group) may be passed when
    the caller has it already. Division, clamp, coding and packing run fused in
    `nvfp4_kernel` (the same fp32 operations as `e2m1_codes` after `div_`/`clamp_`).
    """
    if _kernel is None:
        return _encode_groups_torch(groups, scale_2, group_amax)
    values = groups.numpy()
    if group_amax is None:
        group_amax = torch.from_numpy(_kernel.group_amax(values))
    block_scale = group_scales(group_amax, scale_2)
    divisor = block_scale.to(torch.float32) * scale_2
    return torch.from_numpy(_kernel.encode_packed(values, divisor.numpy())), block_scale


def _encode_groups_torch(
    groups: torch.Tensor, scale_2: torch.Tensor, group_amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode_groups` as torch ops (same bytes); writes into `groups`."""
    if group_amax is None:
        group_amax = groups.abs().amax(dim=-1)
    block_scale = group_scales(group_amax, scale_2)
    divisor = block_scale.to(torch.float32) * scale_2
    groups.div_(divisor[:, None]).clamp_(-E2M1_MAX, E2M1_MAX)
    return pack_nibbles(e2m1_codes(groups)), block_scale


def quantize_nvfp4(
    weight: torch.Tensor, global_amax: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (`weight` uint8 `[N, K/2]`, `weight_scale` e4m3 `[N, K/16]`, `weight_scale_2`)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(
            f"expected a 2-D weight whose K is a multiple of {GROUP}, found shape "
            f"{tuple(weight.shape)}; keep such layers in BF16"
        )
    rows, cols = weight.shape
    scale_2 = global_scale(global_amax)
    # The compiled pass codes by comparing BF16 bits with per-scale bounds found by
    # bisection, which holds for a finite positive `scale_2` only (an inf or NaN weight
    # makes it inf or NaN: then the division below decides, as it defines the bytes).
    if _kernel is not None and weight.dtype == torch.bfloat16 and math.isfinite(scale_2.item()):
        bits = bf16_bits(weight)
        codes, scales = _kernel.quantize_full(bits, scale_2.item())
        block_scale = torch.from_numpy(scales).view(torch.float8_e4m3fn)
        return (
            torch.from_numpy(codes).view(rows, cols // 2),
            block_scale.view(rows, cols // GROUP),
            scale_2,
        )
    packed = torch.empty((rows, cols // 2), dtype=torch.uint8)
    block_scale = torch.empty((rows, cols // GROUP), dtype=torch.float8_e4m3fn)
    # About a million elements per step: few torch calls, fp32 scratch near the cache.
    step = max(1, _ELEMENTS_PER_STEP // max(cols, 1))
    for r in range(0, rows, step):
        chunk = weight[r : r + step].to(torch.float32, copy=True).view(-1, GROUP)
        codes, scales = encode_groups(chunk, scale_2)
        packed[r : r + step] = codes.view(-1, cols // 2)
        block_scale[r : r + step] = scales.view(-1, cols // GROUP)
    return packed, block_scale, scale_2


def dequantize_nvfp4(
    packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """fp32 weight `[N, K]` = E2M1 value × its block's scale × `weight_scale_2`."""
    codes = unpack_nibbles(packed)
    rows, cols = codes.shape
    if tuple(weight_scale.shape) != (rows, cols // GROUP):
        raise ValueError(
            f"weight_scale for a {rows}×{cols} NVFP4 weight must be {(rows, cols // GROUP)}, "
            f"found {tuple(weight_scale.shape)}"
        )
    values = e2m1_values(codes).view(rows, cols // GROUP, GROUP)
    scale = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32)
    return (values * scale[..., None]).view(rows, cols)
