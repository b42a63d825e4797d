"""FP8 E4M3 with 128×128 block scales (`weight_scale_inv`), as SGLang's `fp8` method loads it.

Owns the quantize and dequantize math for one 2-D weight. Dims that are not multiples of
the block count as zero-padded for the per-tile amax (zeros never raise an amax), so the
scale grid is `[ceil(N/128), ceil(K/128)]`. Values are clamped to ±448 before the cast,
which makes the result independent of how a torch build handles out-of-range casts.

The arithmetic is split into `block_amax`, `scales_from_amax` and `encode` so that the
incremental converter (`engine_agent.precision.incremental`) recodes a few elements with
exactly the fp32 operations a full conversion runs: elementwise IEEE division, clamp and
cast give the same bits whether they run over a whole tensor or a gathered subset. A BF16
weight's full conversion runs as one compiled pass (`fp8_kernel.quantize_full`, the same
operations on the BF16 bits, no fp32 copy); the torch ops stay for other dtypes, for
environments without numba, and as the reference the tests hold that pass to.
Must never decide which tensors get quantized (that is `engine_agent.precision.plan`).
"""

from __future__ import annotations

import torch

from engine_agent.precision.compiled import bf16_bits, compiled_kernel

_kernel = compiled_kernel("fp8_kernel", "FP8 conversion runs as torch ops, about 1.5x slower")

BLOCK = 128
E4M3_MAX = 448.0
_ELEMENTS_PER_STEP = 1 << 20


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`weight_scale_inv` entries (fp32) for per-tile amaxes: amax/448, 1.0 for a zero tile."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def encode(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of fp32 `values` divided by `scale` (broadcast), clamped to ±448.

    Writes into `values` (the caller's fp32 scratch) to avoid another buffer.
    """
    values.div_(scale).clamp_(-E4M3_MAX, E4M3_MAX)
    return values.to(torch.float8_e4m3fn)


def _tile_max(chunk: torch.Tensor, block: int) -> torch.Tensor:
    """Per-tile max |x| `[h/b, ⌈K/b⌉]` of an fp32 chunk of whole block rows (the last block
    row of a weight may be short: then `h < b` and it counts as one block row)."""
    rows, cols = chunk.shape
    tile_rows = max(1, rows // block)
    view = chunk.view(tile_rows, -1, cols)
    # max(amax, -amin) is max |x| without materialising |x|; zero padding never raises it.
    colmax = torch.maximum(view.amax(dim=1), view.amin(dim=1).neg_())
    pad = -cols % block
    if pad:
        colmax = torch.nn.functional.pad(colmax, (0, pad))
    return colmax.view(tile_rows, -1, block).amax(dim=2)


def _chunks(rows: int, cols: int, block: int) -> list[tuple[int, int]]:
    """Row ranges of whole block rows, about `_ELEMENTS_PER_STEP` elements each, with a
    short last block row on its own: few enough torch calls that their fixed cost (and,
    with several threads, their synchronisation) stays small, while the fp32 scratch
    stays near the cache."""
    step = block * max(1, _ELEMENTS_PER_STEP // max(block * cols, 1))
    whole = rows - rows % block
    ranges = [(r, min(r + step, whole)) for r in range(0, whole, step)]
    if whole < rows:
        ranges.append((whole, rows))
    return ranges


def block_amax(weight: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """fp32 per-tile max |x| `[⌈N/b⌉, ⌈K/b⌉]` of a 2-D weight."""
    rows, cols = weight.shape
    out = [
        _tile_max(weight[r0:r1].to(torch.float32), block) for r0, r1 in _chunks(rows, cols, block)
    ]
    if not out:
        return torch.empty((0, -(-cols // block)), dtype=torch.float32)
    return torch.cat(out)


def quantize_fp8_block(
    weight: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (`weight` as float8_e4m3fn `[N, K]`, `weight_scale_inv` fp32 `[⌈N/b⌉, ⌈K/b⌉]`)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D Linear weight, found shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    if _kernel is not None and weight.dtype == torch.bfloat16 and block == BLOCK and rows:
        bits = bf16_bits(weight)
        codes, scale = _kernel.quantize_full(bits, (rows, cols))
        q = torch.from_numpy(codes).view(torch.float8_e4m3fn).view(rows, cols)
        return q, torch.from_numpy(scale).view(-(-rows // block), -(-cols // block))
    return quantize_fp8_block_torch(weight, block)


def quantize_fp8_block_torch(
    weight: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_block` as torch ops per chunk of block rows (any float dtype)."""
    rows, cols = weight.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scales = []
    for r0, r1 in _chunks(rows, cols, block):
        chunk = weight[r0:r1].to(torch.float32, copy=True)
        scale = scales_from_amax(_tile_max(chunk, block))
        scales.append(scale)
        per_column = scale.repeat_interleave(block, dim=1)[:, None, :cols]
        tiles = chunk.view(scale.shape[0], -1, cols)
        q[r0:r1] = encode(tiles, per_column).view(r1 - r0, cols)
    if not scales:
        return q, torch.empty((0, -(-cols // block)), dtype=torch.float32)
    return q, torch.cat(scales).contiguous()


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
