"""Synthetic checkpoints: random BF16 tensors and small training-like updates to them.

For the demo, tests and quick experiments: deterministic from a seed, numpy only (BF16 is
the upper 16 bits of a float32). Never used on a real training path.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from store.tensors import RawTensor

DEFAULT_SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.1.self_attn.q_proj.weight": (64, 64),
    "model.layers.1.mlp.up_proj.weight": (128, 64),
    "model.norm.weight": (64,),
}


def bf16_from_float32(values: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) of float32 values, by truncation to the upper 16 bits."""
    return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def random_checkpoint(
    seed: int = 0,
    shapes: Mapping[str, tuple[int, ...]] = DEFAULT_SHAPES,
    std: float = 0.02,
) -> dict[str, RawTensor]:
    """BF16 tensors drawn from N(0, std²), named and shaped by `shapes`."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        values = rng.normal(0.0, std, size=shape).astype(np.float32)
        tensors[name] = RawTensor(
            "BF16", tuple(shape), bf16_from_float32(values).reshape(-1).view(np.uint8)
        )
    return tensors


def small_update(
    tensors: Mapping[str, RawTensor], seed: int, fraction: float = 0.05
) -> dict[str, RawTensor]:
    """A copy where about `fraction` of each BF16 tensor's elements moved by one ulp or two.

    The input is left untouched, as a training step leaves the published version untouched.
    """
    rng = np.random.default_rng(seed)
    updated = {}
    for name, tensor in tensors.items():
        bits = tensor.bits().copy()
        changed = rng.random(bits.size) < fraction
        steps = rng.choice(np.array([-2, -1, 1, 2], dtype=np.int32), size=int(changed.sum()))
        bits[changed] = (bits[changed].astype(np.int32) + steps).astype(bits.dtype)
        updated[name] = RawTensor(tensor.dtype, tensor.shape, bits.view(np.uint8))
    return updated
