"""Converting canonical BF16 tensors to a servable BF16, FP8-block or NVFP4 checkpoint.

Owns `convert_tensors` (tensors + config in, tensors + config + extra JSON files out) and
`convert_checkpoint` (the same, written as a loadable Hugging Face folder). Deterministic:
the same input tensors, precision and input scales give identical bytes in any process.
Tensors that stay BF16 are copied bit for bit. Must never fetch versions or talk to an
engine: the agent decides when to convert and where the folder goes.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_agent.precision import fp8, nvfp4
from engine_agent.precision.calibration import calibrate_input_scales
from engine_agent.precision.checkpoint import (
    copy_side_files,
    read_config,
    read_tensors,
    write_safetensors_folder,
)
from engine_agent.precision.plan import QuantPlan, check_precision, plan_quantization

log = logging.getLogger(__name__)

MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.0.0+tether"}
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class ConversionStats:
    """What a conversion did: counts, sizes and time."""

    precision: str
    out_dir: str
    quantized_modules: int
    kept_tensors: int
    bytes_written: int
    seconds: float
    input_scales_source: str


def fp8_quantization_config(plan: QuantPlan) -> dict[str, Any]:
    """`quantization_config` for SGLang's `fp8` method with 128×128 blocks."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
        # Dotted paths, not globs: SGLang's fp8 matcher compares names.
        "modules_to_not_convert": sorted({"model.embed_tokens", *plan.kept_linears, *plan.norms}),
    }


def nvfp4_quantization_config(plan: QuantPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    """(flat `config.json` `quantization_config`, nested `hf_quant_config.json`) for NVFP4."""
    ignore = sorted(set(plan.kept_linears))
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": nvfp4.GROUP}
    flat = {
        "config_groups": {
            "group_0": {
                "input_activations": dict(args),
                "weights": dict(args),
                "targets": ["Linear"],
            }
        },
        "ignore": ignore,
        "quant_algo": "NVFP4",
        "producer": dict(MODELOPT_PRODUCER),
        "quant_method": "modelopt",
    }
    nested = {
        "producer": dict(MODELOPT_PRODUCER),
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": nvfp4.GROUP,
            "exclude_modules": ignore,
        },
    }
    return flat, nested


def _require_bf16_source(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype in (torch.float8_e4m3fn, torch.uint8) or name.endswith("_scale_inv"):
            raise ValueError(
                f"expected canonical BF16/FP32 tensors, found {name} as {tensor.dtype}; "
                "convert from the BF16 version, never from an already quantized folder"
            )


def convert_tensors(
    tensors: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    precision: str,
    input_scales: Mapping[str, float] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, dict[str, Any]]]:
    """Quantize canonical tensors; return (tensors, config.json dict, extra JSON files).

    NVFP4 needs an `input_scale` for every quantized module: pass `input_scales`
    (module name → scale), e.g. from `read_input_scales` or `calibrate_input_scales`.
    """
    precision = check_precision(precision)
    _require_bf16_source(tensors)
    plan = plan_quantization(dict(tensors), precision)
    out_config = copy.deepcopy(config)
    out_config.pop("quantization_config", None)
    out_config["torch_dtype"] = "bfloat16"
    quantized = set(plan.quantized)
    out: dict[str, torch.Tensor] = {
        name: t for name, t in tensors.items() if name[: -len(".weight")] not in quantized
    }
    extra: dict[str, dict[str, Any]] = {}
    if precision == "fp8":
        for module in plan.quantized:
            q, scale_inv = fp8.quantize_fp8_block(tensors[f"{module}.weight"])
            out[f"{module}.weight"] = q
            out[f"{module}.weight_scale_inv"] = scale_inv
        out_config["quantization_config"] = fp8_quantization_config(plan)
    elif precision == "nvfp4":
        missing = [m for m in plan.quantized if m not in (input_scales or {})]
        if missing:
            raise ValueError(
                f"NVFP4 needs an input_scale for every quantized module; missing {missing[:3]}"
                f" ({len(missing)} in all); pass input_scales from the boot checkpoint or "
                "calibrate_input_scales(...)"
            )
        for group in plan.groups:
            group_amax = max(nvfp4.tensor_amax(tensors[f"{m}.weight"]) for m in group)
            scales = input_scales or {}
            shared_input = max(float(scales[m]) for m in group)
            for module in group:
                packed, block_scale, scale_2 = nvfp4.quantize_nvfp4(
                    tensors[f"{module}.weight"], group_amax
                )
                out[f"{module}.weight"] = packed
                out[f"{module}.weight_scale"] = block_scale
                out[f"{module}.weight_scale_2"] = scale_2
                out[f"{module}.input_scale"] = torch.tensor(shared_input, dtype=torch.float32)
        flat, nested = nvfp4_quantization_config(plan)
        out_config["quantization_config"] = flat
        extra[HF_QUANT_CONFIG] = nested
    return out, out_config, extra


def convert_checkpoint(
    source: str | Path | Mapping[str, torch.Tensor],
    precision: str,
    out_dir: str | Path,
    input_scales: Mapping[str, float] | None = None,
    *,
    config: dict[str, Any] | None = None,
    side_files_from: str | Path | None = None,
) -> ConversionStats:
    """Write `source` (a BF16 folder, or tensors + `config`) at `precision` into `out_dir`.

    NVFP4 without `input_scales` calibrates them once from a few prompts (tokenizer taken
    from the source folder or `side_files_from`). Tokenizer and generation files are copied
    from the source folder or `side_files_from`.
    """
    started = time.perf_counter()
    precision = check_precision(precision)
    if isinstance(source, str | Path):
        tensors = read_tensors(source)
        config = read_config(source) if config is None else config
        side_files_from = side_files_from or source
    else:
        tensors = dict(source)
        if config is None:
            raise ValueError("convert_checkpoint(tensors, ...) needs config=<config.json dict>")
    scales_source = "given" if input_scales is not None else "none"
    if precision == "nvfp4" and input_scales is None:
        plan = plan_quantization(tensors, precision)
        input_scales = calibrate_input_scales(tensors, config, plan, side_files_from)
        scales_source = "calibrated"
    out_tensors, out_config, extra = convert_tensors(tensors, config, precision, input_scales)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    size = write_safetensors_folder(out, out_tensors)
    (out / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
    for name, body in extra.items():
        (out / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    if side_files_from is not None:
        copy_side_files(side_files_from, out)
    stale = out / HF_QUANT_CONFIG
    if HF_QUANT_CONFIG not in extra and stale.exists():
        stale.unlink()
    quantized = sum(1 for n in out_tensors if n.endswith((".weight_scale_inv", ".weight_scale")))
    stats = ConversionStats(
        precision=precision,
        out_dir=str(out),
        quantized_modules=quantized,
        kept_tensors=len(out_tensors) - quantized * (2 if precision == "fp8" else 4),
        bytes_written=size,
        seconds=time.perf_counter() - started,
        input_scales_source=scales_source,
    )
    log.info("converted checkpoint to %s in %.2fs: %s", precision, stats.seconds, out)
    return stats
