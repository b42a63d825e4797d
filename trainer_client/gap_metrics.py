"""How far the sampler that generated a batch is from the trainer that learns from it.

Owns the sampler-gap metrics a trainer logs per step (and per precision class): mean
|log p_trainer − log q|, the k3 estimate of KL(q ‖ p_trainer), the fraction of tokens that an
MIS band would mask out, and the head masses of a top-K sampler head. All are computed on
detached tensors over the trainable positions of a mask and returned as plain floats.

This module must never change a loss or a gradient; it only observes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

#: Per-token log-ratios are clamped to ±this before exponentiation.
_LOG_RATIO_CLAMP = 20.0
#: The k3 KL estimate is clamped to ±this, as Miles' `low_var_kl` is.
_KL_CLAMP = 10.0


@dataclass(frozen=True)
class GapMetrics:
    """Sampler/trainer gap over the trainable tokens of one batch (or one precision class).

    - `logprob_abs_diff`: mean |log p − log q| of the sampled tokens;
    - `k3_kl`: mean(r − 1 − log r), r = p/q — a non-negative, low-variance estimate of
      KL(q ‖ p) for tokens sampled from q;
    - `masked_fraction`: fraction of tokens with r outside the MIS band [low, high];
    - `trainer_head_mass` / `sampler_head_mass`: mean Σ_{v∈H} p_v and Σ_{v∈H} q_v over a
      top-K head (None when no head was given);
    - `tokens`: how many trainable tokens the means are over.
    """

    logprob_abs_diff: float
    k3_kl: float
    masked_fraction: float
    tokens: int
    trainer_head_mass: float | None = None
    sampler_head_mass: float | None = None

    def as_dict(self) -> dict[str, float]:
        """Flat name → float mapping for a metrics logger (absent head masses left out)."""
        return {
            f"gap_{name}": float(value) for name, value in asdict(self).items() if value is not None
        }


def gap_metrics(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    *,
    mis_low: float = 0.5,
    mis_high: float = 5.0,
    trainer_head_logprobs: Tensor | None = None,
    sampler_head_logprobs: Tensor | None = None,
    head_valid: Tensor | None = None,
) -> GapMetrics:
    """Measure the gap between trainer and sampler log-probs of the sampled tokens.

    `trainer_logprobs`, `sampler_logprobs` and `mask` are [B, T]. The optional head tensors
    are [B, T, K] log-probs of the sampler's top-K ids under each policy, with `head_valid`
    marking real (non-padding) entries; when given, the head masses are reported too.
    An empty mask gives zeros, never NaN.
    """
    if trainer_logprobs.shape != sampler_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(
            "trainer_logprobs, sampler_logprobs and mask must share one shape, got "
            f"{tuple(trainer_logprobs.shape)}, {tuple(sampler_logprobs.shape)}, "
            f"{tuple(mask.shape)}"
        )
    m = mask.to(torch.bool)
    count = int(m.sum())
    if count == 0:
        return GapMetrics(0.0, 0.0, 0.0, 0)
    log_r = (trainer_logprobs.detach() - sampler_logprobs.detach()).double()[m]
    log_r = log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = float((log_r.exp() - 1.0 - log_r).mean().clamp(-_KL_CLAMP, _KL_CLAMP))
    outside = (log_r < math.log(mis_low)) | (log_r > math.log(mis_high))
    result = GapMetrics(
        logprob_abs_diff=float(log_r.abs().mean()),
        k3_kl=k3,
        masked_fraction=float(outside.double().mean()),
        tokens=count,
    )
    if trainer_head_logprobs is None or sampler_head_logprobs is None:
        return result
    valid = (
        torch.ones_like(trainer_head_logprobs, dtype=torch.bool)
        if head_valid is None
        else head_valid.to(torch.bool)
    )
    return replace(
        result,
        trainer_head_mass=head_mass(trainer_head_logprobs, valid, m),
        sampler_head_mass=head_mass(sampler_head_logprobs, valid, m),
    )


def head_mass(head_logprobs: Tensor, head_valid: Tensor, mask: Tensor) -> float:
    """Mean over trainable tokens of Σ_{v∈H} exp(log p_v) for a [B, T, K] head."""
    m = mask.to(torch.bool)
    if not m.any():
        return 0.0
    valid = head_valid.to(torch.bool)
    lp = head_logprobs.detach().double()
    probs = torch.where(valid, lp.exp(), torch.zeros_like(lp))
    return float(probs.sum(dim=-1)[m].mean())
