"""NVFP4 `input_scale`: calibrated once from a few prompts, or read from a checkpoint.

Owns the activation amax measurement (a CPU forward of the BF16 model with a hook on every
quantized Linear's input) and the rule that turns amaxes into stored scales: the group max
(q/k/v and gate/up see the same input), times a safety margin of 2, rounded up to a power
of two, divided by 6 · 448. The rounding makes the scale robust to last-bit differences
between machines, so two agents that calibrate independently still write identical bytes.
Must never change weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine_agent.precision.plan import QuantPlan

MARGIN = 2.0
NVFP4_RANGE = 6.0 * 448.0
DEFAULT_PROMPTS = (
    "3+5=8",
    "what is the sum of 12 and 7? 19",
    "You are a helpful assistant. Answer the question: 9+9=18",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
)


def scale_from_amax(amax: float) -> float:
    """The stored `input_scale` for an observed activation amax."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * MARGIN)) / NVFP4_RANGE


def read_input_scales(folder: str | Path) -> dict[str, float]:
    """Module → `input_scale` from an NVFP4 checkpoint folder (empty when it has none)."""
    from engine_agent.precision.checkpoint import read_tensors

    return {
        name[: -len(".input_scale")]: float(t.to(torch.float32).reshape(()).item())
        for name, t in read_tensors(folder).items()
        if name.endswith(".input_scale")
    }


def _prompt_ids(tokenizer_dir: str | Path | None, vocab_size: int) -> list[list[int]]:
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return [tok(p).input_ids for p in DEFAULT_PROMPTS]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (32,), generator=generator).tolist() for _ in range(4)]


def calibrate_input_scales(
    tensors: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    plan: QuantPlan,
    tokenizer_dir: str | Path | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
) -> dict[str, float]:
    """Run the BF16 model on a few prompts; return module → `input_scale` for the plan."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    state = {k: v.to(torch.float32) for k, v in tensors.items()}
    model.load_state_dict(state, strict=False)
    model.eval()
    wanted = set(plan.quantized)
    amax: dict[str, float] = dict.fromkeys(wanted, 0.0)

    def hook_for(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax[name], float(args[0].detach().abs().max()))

        return hook

    handles = [
        module.register_forward_pre_hook(hook_for(name))
        for name, module in model.named_modules()
        if name in wanted
    ]
    ids = prompts or _prompt_ids(tokenizer_dir, config["vocab_size"])
    try:
        with torch.inference_mode():
            for seq in ids:
                model(torch.tensor([list(seq)], dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()
    scales: dict[str, float] = {}
    for group in plan.groups:
        shared = scale_from_amax(max(amax[m] for m in group))
        scales.update(dict.fromkeys(group, shared))
    return scales
