"""Which tensors of a checkpoint get quantized, and which share scales.

Owns the keep-list and the fused groups:

- quantized: 2-D `*.weight` of Linear layers inside decoder blocks (`model.layers.*`);
- kept in BF16: embeddings, `lm_head`, norms, biases (every 1-D tensor), MoE routers
  (`mlp.gate`, `router`, `shared_expert_gate`) and, for NVFP4, every layer whose K is not
  a multiple of 16 together with the rest of its fused group;
- fused groups (one NVFP4 `weight_scale_2` and `input_scale` each): q/k/v of one attention
  block, gate/up of one MLP or expert.

Must never touch tensor values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

PRECISIONS = ("bf16", "fp8", "nvfp4")

_ROUTER = re.compile(r"(^|\.)(mlp\.gate|router|shared_expert_gate|gate)$")
_QKV = re.compile(r"^(?P<base>.*\.self_attn)\.(q|k|v)_proj$")
_GATE_UP = re.compile(r"^(?P<base>.*)\.(gate|up)_proj$")


@dataclass(frozen=True)
class QuantPlan:
    """Groups of Linear modules to quantize (fused members together) and what stays BF16."""

    precision: str
    groups: tuple[tuple[str, ...], ...]
    kept_linears: tuple[str, ...]
    norms: tuple[str, ...] = field(default=())

    @property
    def quantized(self) -> tuple[str, ...]:
        return tuple(m for g in self.groups for m in g)


def check_precision(precision: str) -> str:
    """Normalise a precision name or raise with the accepted ones."""
    name = precision.lower()
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, found {precision!r}")
    return name


def group_key(module: str) -> str:
    """The fused-group name of a Linear module (its own name when it is not fused)."""
    if match := _QKV.match(module):
        return f"{match['base']}.qkv_proj"
    if match := _GATE_UP.match(module):
        return f"{match['base']}.gate_up_proj"
    return module


def _is_decoder_linear(name: str, tensor: torch.Tensor) -> bool:
    if not name.endswith(".weight") or tensor.dim() != 2:
        return False
    module = name[: -len(".weight")]
    return ".layers." in f".{module}" and not _ROUTER.search(module)


def plan_quantization(shapes: dict[str, torch.Tensor], precision: str) -> QuantPlan:
    """Decide, from names and shapes only, what `precision` quantizes in this checkpoint."""
    precision = check_precision(precision)
    norms = tuple(sorted(n[: -len(".weight")] for n, t in shapes.items() if "norm" in n))
    linears = sorted(n[: -len(".weight")] for n, t in shapes.items() if _is_decoder_linear(n, t))
    other_linears = sorted(
        n[: -len(".weight")]
        for n, t in shapes.items()
        if n.endswith(".weight")
        and t.dim() == 2
        and not _is_decoder_linear(n, t)
        and "embed" not in n
    )
    if precision == "bf16":
        return QuantPlan(precision, (), tuple(other_linears + linears), norms)
    grouped: dict[str, list[str]] = {}
    for module in linears:
        grouped.setdefault(group_key(module), []).append(module)
    groups: list[tuple[str, ...]] = []
    kept = list(other_linears)
    for key in sorted(grouped):
        members = tuple(grouped[key])
        fits = precision != "nvfp4" or all(
            shapes[f"{m}.weight"].shape[1] % 16 == 0 for m in members
        )
        if fits:
            groups.append(members)
        else:
            kept.extend(members)
    return QuantPlan(precision, tuple(groups), tuple(sorted(kept)), norms)
