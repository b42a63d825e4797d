"""Loading BF16, FP8-block and NVFP4 checkpoint folders into a live torch model.

Owns dequantization at load (FP8 `weight` × `weight_scale_inv` per 128×128 tile; NVFP4
E2M1 × `weight_scale` × `weight_scale_2`) and the in-place copy of every parameter, so an
update never rebuilds the model. Must never serve requests or decide when to load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_agent.precision.checkpoint import read_config, read_tensors
from engine_agent.precision.fp8 import dequantize_fp8_block
from engine_agent.precision.nvfp4 import dequantize_nvfp4
from store.errors import TensorMismatch

_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")


def checkpoint_precision(config: dict) -> str:
    """ "bf16", "fp8" or "nvfp4" from a config.json's `quantization_config`."""
    quant = config.get("quantization_config")
    if not quant:
        return "bf16"
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method.startswith("modelopt") and "FP4" in str(quant.get("quant_algo", "")).upper():
        return "nvfp4"
    raise ValueError(
        f"expected no quantization_config, fp8 (block) or modelopt NVFP4, found {quant!r}; "
        "write the folder with `engine_agent.precision.convert_checkpoint`"
    )


def dequantized_tensors(folder: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every parameter of a checkpoint folder as a compute-ready tensor, and its precision."""
    config = read_config(folder)
    precision = checkpoint_precision(config)
    raw = read_tensors(folder)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if name.endswith(_SCALE_SUFFIXES):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module and f"{module}.weight_scale_inv" in raw:
            out[name] = dequantize_fp8_block(tensor, raw[f"{module}.weight_scale_inv"])
        elif module and f"{module}.weight_scale_2" in raw:
            out[name] = dequantize_nvfp4(
                tensor, raw[f"{module}.weight_scale"], raw[f"{module}.weight_scale_2"]
            )
        else:
            out[name] = tensor
    return out, precision


def copy_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Copy `tensors` into the model's parameters in place; return how many were copied.

    Every parameter the model owns must be present (a tied `lm_head` may be absent), with
    the same shape; otherwise nothing is copied.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [n for n in params if n not in tensors and not (tied and n == "lm_head.weight")]
    unexpected = [n for n in tensors if n not in params]
    wrong = [
        f"{n}: model {tuple(params[n].shape)} vs file {tuple(t.shape)}"
        for n, t in tensors.items()
        if n in params and tuple(params[n].shape) != tuple(t.shape)
    ]
    if missing or unexpected or wrong:
        raise TensorMismatch(
            f"checkpoint does not match the served model: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, shape mismatches {wrong[:3]}; load a checkpoint of the same "
            "architecture"
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    return len(tensors)
