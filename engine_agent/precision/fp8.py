"""FP8 E4M3 with 128×128 block scales (`weight_scale_inv`), as SGLang's `fp8` method loads it.

Owns the quantize and dequantize math for one 2-D weight. Dims that are not multiples of
the block are zero-padded for the per-tile amax and cropped afterwards, so the scale grid
is `[ceil(N/128), ceil(K/128)]`. Values are clamped to ±448 before the cast, which makes
the result independent of how a torch build handles out-of-range casts. Must never decide
which tensors get quantized (that is `engine_agent.precision.plan`).
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = w.shape
    pad_rows = -rows % block
    pad_cols = -cols % block
    return torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))


def quantize_fp8_block(
    weight: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (`weight` as float8_e4m3fn `[N, K]`, `weight_scale_inv` fp32 `[⌈N/b⌉, ⌈K/b⌉]`)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D Linear weight, found shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    padded = _pad_to_blocks(weight.to(torch.float32), block)
    tiles = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    quotient = tiles / scale[:, None, :, None]
    q = quotient.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(padded.shape)[:rows, :cols].contiguous()
    return q, scale.contiguous()


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """fp32 weight `[N, K]` = each 128×128 tile of `q` times its `scale_inv` entry."""
    rows, cols = q.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv for a {rows}×{cols} weight must have shape {expected}, "
            f"found {tuple(scale_inv.shape)}; was the checkpoint written with block {block}?"
        )
    full = scale_inv.to(torch.float32).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.to(torch.float32) * full[:rows, :cols]
