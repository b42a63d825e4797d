"""SGLang's `sampling_params` for the reference engine: parsing, defaults and token choice.

Owns the field names and defaults of SGLang 0.5.23 (`max_new_tokens=128`,
`temperature=1.0`, `top_p=1.0`, `top_k=1<<30`, `sampling_seed=None`, ...), its 0.5.22+
contract gate (an unknown key such as `max_tokens` or `seed` is a 400), and the choice of
the next token from one row of logits. Logprobs are of the temperature-scaled
distribution before top-k/top-p/min-p, the distribution the sampler draws from before
truncation. Must never touch the model or the HTTP layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import torch

TOP_K_ALL = 1 << 30
GREEDY_EPS = 1e-6

# Accepted by SGLang but not implemented here: a non-null value is refused, not ignored.
_UNSUPPORTED = (
    "stop_regex",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)


class SamplingParamsError(ValueError):
    """A `sampling_params` body the engine cannot accept (answered with HTTP 400)."""


@dataclass
class SamplingParams:
    """One request's sampling parameters with SGLang's defaults."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    n: int = 1
    sampling_seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def _known_fields() -> list[str]:
    return [f.name for f in fields(SamplingParams)] + list(_UNSUPPORTED)


def parse_sampling_params(body: dict | None) -> SamplingParams:
    """Build `SamplingParams` from a request body, refusing unknown or unsupported keys."""
    body = dict(body or {})
    known = _known_fields()
    for key in body:
        if key not in known:
            expected = ", ".join(f"`{k}`" for k in known)
            raise SamplingParamsError(f"unknown field `{key}`, expected one of {expected}")
    for key in _UNSUPPORTED:
        if body.pop(key, None) is not None:
            raise SamplingParamsError(
                f"sampling_params.{key} is not supported by the CPU reference engine; "
                "drop it or use an SGLang engine"
            )
    values = {k: v for k, v in body.items() if v is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    params = SamplingParams(**values)
    if params.top_k in (-1, 0):
        params.top_k = TOP_K_ALL
    if params.max_new_tokens < 0 or params.temperature < 0 or not 0 < params.top_p <= 1:
        raise SamplingParamsError(
            "expected max_new_tokens ≥ 0, temperature ≥ 0 and 0 < top_p ≤ 1, found "
            f"{params.max_new_tokens}, {params.temperature}, {params.top_p}"
        )
    return params


def make_generator(seed: int | None) -> torch.Generator:
    """A private generator: seeded for reproducible sampling, else from the OS."""
    value = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator().manual_seed(value)


def _apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    if params.logit_bias:
        for token, bias in params.logit_bias.items():
            logits[int(token)] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        picked = logits[seen]
        logits[seen] = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    prompt: list[int],
    output: list[int],
) -> tuple[int, torch.Tensor]:
    """Pick the next token from a 1-D fp32 logits row; return (token, logprobs row)."""
    logits = _apply_penalties(logits.clone(), params, prompt, output)
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        return int(torch.argmax(logits)), logprobs
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    if params.top_k < probs.shape[0]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > params.top_p * cumulative[-1]
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return token, logprobs
