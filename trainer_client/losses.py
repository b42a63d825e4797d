"""RL losses that correct for the sampler/trainer gap: GRPO advantages, TIS, MIS, score centering.

Pure torch, no I/O and no distributed calls: every function takes tensors and returns tensors
(plus plain-float metrics), so a trainer can call it inside any framework's loss hook. The
formulas follow `shared/specs/rl-corrections.md`; `docs/rl-corrections.md` maps each one.

Shapes: `B` sequences (responses) of `T` response positions, padded; `mask` [B, T] marks the
trainable positions (1) and padding / tool / observation tokens (0). Log-probabilities are
natural-log, fp32 or fp64, already divided by the sampling temperature once.

Invariants this module keeps:
- every importance weight and centering coefficient is detached: gradients flow only through
  the trainer's log-probabilities, never through a correction;
- a correction changes the numerator of a reduction only: a token that MIS masks out still
  counts in the denominator, so rejected tokens are never renormalised away;
- unbounded ratios are never exponentiated: log-ratios are clamped (±20) or capped in log
  space before `exp`.

This module must never read a checkpoint, talk to an engine or choose hyper-parameters at
run time; it only computes.

Why about 500 lines: GRPO advantages, TIS, MIS and score centering share the masking and
clamping helpers and are read together when checking one loss against the docs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

Correction = Literal["none", "tis", "mis"]
RatioLevel = Literal["token", "sequence", "geometric"]
Normalization = Literal["token", "sequence"]

#: Default TIS cap `c` (Miles `--tis-clip`, SC `--score-centering-tis-clip`).
TIS_CAP = 2.0
#: Default MIS band [L, U] (score-centering MIS recipe; IcePop's recipe uses U = 2).
MIS_LOW = 0.5
MIS_HIGH = 5.0
#: Log-ratios are clamped to ±this before exponentiation.
LOG_RATIO_CLAMP = 20.0
#: Floor on head-complement masses in the proportional-tail model.
TAIL_FLOOR = 1e-6
#: Added to the group standard deviation when GRPO normalises by it.
GRPO_STD_EPS = 1e-6


class InvalidLossInput(ValueError):
    """A loss received tensors or hyper-parameters it cannot use (shape, NaN, bad band)."""


@dataclass
class LossOutput:
    """A scalar loss to minimise (with grad) and plain-float metrics for logging."""

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- advantages


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    normalize_std: bool = False,
    eps: float = GRPO_STD_EPS,
) -> Tensor:
    """Group-relative advantages: `R − mean_group(R)`, optionally ÷ (unbiased std + eps).

    `rewards` is 1-D, ordered so that each run of `group_size` consecutive entries is one
    prompt's group. Std normalisation is off by default (Dr.GRPO, the score-centering
    recipe); it is skipped for groups of one and for groups whose std is zero (their
    centred rewards are already zero). Returns a tensor shaped like `rewards`, one scalar
    per sequence: broadcast it over the response tokens.
    """
    if rewards.dim() != 1:
        raise InvalidLossInput(
            f"rewards must be 1-D (one reward per sequence), got shape {tuple(rewards.shape)}"
        )
    if group_size < 1 or rewards.numel() % group_size:
        raise InvalidLossInput(
            f"{rewards.numel()} rewards cannot be split into groups of {group_size}: "
            "pass a group size that divides the number of rewards"
        )
    if not torch.isfinite(rewards).all():
        raise InvalidLossInput("rewards contain NaN or infinity; fix the reward function")
    grouped = rewards.detach().reshape(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std = grouped.std(dim=1, keepdim=True, unbiased=True)
        centred = torch.where(std > 0, centred / (std + eps), centred)
    return centred.reshape(rewards.shape)


# --------------------------------------------------------------------------- reduction


def reduce_masked(values: Tensor, mask: Tensor, normalization: Normalization = "token") -> Tensor:
    """Reduce per-token `values` [B, T] over the trainable positions of `mask`.

    - `"token"`: Σ m·x / Σ_i max(Σ_t m_i,t, 1) — every trainable token weighs the same;
    - `"sequence"`: mean over sequences of Σ_t m·x / max(Σ_t m_i,t, 1).

    Denominators come from `mask` alone; fold any correction weight into `values`, so it
    changes the numerator only.
    """
    m = mask.to(values.dtype)
    per_sequence_tokens = m.sum(dim=-1).clamp_min(1.0)
    numerators = (values * m).sum(dim=-1)
    if normalization == "token":
        return numerators.sum() / per_sequence_tokens.sum()
    if normalization == "sequence":
        return (numerators / per_sequence_tokens).mean()
    raise InvalidLossInput(f"normalization must be 'token' or 'sequence', got {normalization!r}")


# --------------------------------------------------------------------------- TIS / MIS


def _check_band(correction: str, tis_cap: float, mis_low: float, mis_high: float) -> None:
    if correction == "tis" and not (math.isfinite(tis_cap) and tis_cap > 0):
        raise InvalidLossInput(f"TIS cap must be a positive finite number, got {tis_cap}")
    if correction == "mis" and not (
        math.isfinite(mis_low) and math.isfinite(mis_high) and 0 < mis_low <= mis_high
    ):
        raise InvalidLossInput(
            f"MIS band must satisfy 0 < low <= high (finite), got [{mis_low}, {mis_high}]"
        )
    if correction not in ("none", "tis", "mis"):
        raise InvalidLossInput(f"correction must be 'none', 'tis' or 'mis', got {correction!r}")


def _level_log_ratio(log_ratio: Tensor, mask: Tensor, level: RatioLevel) -> Tensor:
    """Token log-ratios, or per-sequence sums / means broadcast back over the tokens."""
    m = mask.to(log_ratio.dtype)
    if level == "token":
        return log_ratio
    summed = (log_ratio * m).sum(dim=-1, keepdim=True)
    if level == "sequence":
        return summed.expand_as(log_ratio)
    if level == "geometric":
        return (summed / m.sum(dim=-1, keepdim=True).clamp_min(1.0)).expand_as(log_ratio)
    raise InvalidLossInput(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")


def weight_from_log_ratio(
    log_ratio: Tensor,
    correction: Correction,
    *,
    tis_cap: float = TIS_CAP,
    mis_low: float = MIS_LOW,
    mis_high: float = MIS_HIGH,
) -> Tensor:
    """f(r) for r = exp(log_ratio), computed in log space and detached.

    none → 1; tis → min(r, c); mis → r if L ≤ r ≤ U else 0.
    """
    _check_band(correction, tis_cap, mis_low, mis_high)
    d = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if correction == "none":
        return torch.ones_like(d)
    if correction == "tis":
        return d.clamp(max=math.log(tis_cap)).exp()
    in_band = (d >= math.log(mis_low)) & (d <= math.log(mis_high))
    return torch.where(in_band, d.clamp(max=math.log(mis_high)).exp(), torch.zeros_like(d))


def importance_weights(
    behaviour_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    correction: Correction = "mis",
    *,
    level: RatioLevel = "token",
    tis_cap: float = TIS_CAP,
    mis_low: float = MIS_LOW,
    mis_high: float = MIS_HIGH,
) -> Tensor:
    """Detached behaviour-correction weights [B, T] for ρ = p_behaviour / q.

    `behaviour_logprobs` is the trainer's log-prob of each sampled token before the step
    (p_old), `sampler_logprobs` the one the engine recorded (q). At `"sequence"` level ρ is
    the product over the sequence's trainable tokens, at `"geometric"` level its geometric
    mean; either is broadcast to every token, so MIS keeps or drops whole sequences. TIS
    caps ρ at `tis_cap` (no lower clip); MIS keeps ρ inside [mis_low, mis_high] and zeroes
    it outside. Padding positions get weight 0.
    """
    _check_same_shape(behaviour_logprobs=behaviour_logprobs, sampler_logprobs=sampler_logprobs)
    _check_same_shape(behaviour_logprobs=behaviour_logprobs, mask=mask)
    m = mask.to(torch.bool)
    log_ratio = torch.where(m, behaviour_logprobs.detach() - sampler_logprobs.detach(), 0.0)
    level_ratio = _level_log_ratio(log_ratio, m, level)
    weights = weight_from_log_ratio(
        level_ratio, correction, tis_cap=tis_cap, mis_low=mis_low, mis_high=mis_high
    )
    return torch.where(m, weights, torch.zeros_like(weights))


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise InvalidLossInput(f"tensors must share one shape, got {shapes}")


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Broadcast per-sequence advantages [B] to [B, T]; pass [B, T] through."""
    a = advantages.detach().to(like.dtype)
    if a.dim() == 1 and a.shape[0] == like.shape[0]:
        a = a.unsqueeze(-1).expand_as(like)
    if a.shape != like.shape:
        raise InvalidLossInput(
            f"advantages must be [B] or [B, T] = {tuple(like.shape)}, got {tuple(advantages.shape)}"
        )
    if not torch.isfinite(a).all():
        raise InvalidLossInput("advantages contain NaN or infinity")
    return a


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    m = mask.to(torch.bool)
    count = int(m.sum())
    return float(values.detach()[m].double().sum() / count) if count else 0.0


def policy_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    correction: Correction = "mis",
    *,
    old_logprobs: Tensor | None = None,
    level: RatioLevel = "token",
    tis_cap: float = TIS_CAP,
    mis_low: float = MIS_LOW,
    mis_high: float = MIS_HIGH,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    normalization: Normalization = "token",
) -> LossOutput:
    """Clipped policy-gradient loss with a TIS or MIS behaviour correction (decoupled PPO).

    ℓ_t = w_t · max(−r_t·A_t, −clip(r_t, 1−ε, 1+ε_h)·A_t), with r_t = p_θ/p_old (log-ratio
    clamped ±20) and w_t = f(p_old/q) from `importance_weights`. `logprobs` (p_θ) carries
    the gradient. Without `old_logprobs` the anchor is `logprobs.detach()`: r = 1, the clip
    is inactive and the gradient is the corrected REINFORCE one, −w·A·∇log p_θ — the usual
    single-update-per-batch asynchronous setting. Reduced by `reduce_masked`.

    Metrics: `pg_clipfrac`, `ppo_kl` (mean log p_old − log p_θ), `is_weight_mean`, and the
    fraction of tokens TIS capped (`tis_capped_fraction`) or MIS dropped
    (`mis_masked_fraction`).
    """
    _check_same_shape(logprobs=logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    anchor = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
    _check_same_shape(logprobs=logprobs, old_logprobs=anchor)
    m = mask.to(torch.bool)
    a = _token_advantages(advantages, logprobs)
    weights = importance_weights(
        anchor,
        sampler_logprobs,
        m,
        correction,
        level=level,
        tis_cap=tis_cap,
        mis_low=mis_low,
        mis_high=mis_high,
    )
    ppo_kl = torch.where(m, anchor - logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp((-ppo_kl).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -ratio * a
    clipped = -ratio.clamp(1.0 - clip_eps, 1.0 + high) * a
    per_token = torch.maximum(unclipped, clipped) * weights
    loss = reduce_masked(per_token, m, normalization)

    metrics = {
        "pg_clipfrac": _masked_mean((clipped > unclipped).to(logprobs.dtype), m),
        "ppo_kl": _masked_mean(ppo_kl, m),
        "is_weight_mean": _masked_mean(weights, m),
    }
    if correction != "none":
        level_ratio = _level_log_ratio(
            torch.where(m, anchor - sampler_logprobs.detach(), 0.0), m, level
        )
        if correction == "tis":
            metrics["tis_capped_fraction"] = _masked_mean(
                (level_ratio > math.log(tis_cap)).to(logprobs.dtype), m
            )
        else:
            metrics["mis_masked_fraction"] = _masked_mean((weights == 0).to(logprobs.dtype), m)
    return LossOutput(loss=loss, metrics=metrics)


# --------------------------------------------------------------------------- score centering


@dataclass
class CenteringTerms:
    """Detached per-token quantities of the score-centred surrogate (§6.2–6.3).

    `token_weight` [B, T] is w_t = f(p_θ(a_t)/q(a_t)); `head_coef` [B, T, K] is
    c_v = q_v·f(p_v/q_v) − α·p_v on the sampler head (0 on padding and masked tokens);
    `head_mass_trainer`/`head_mass_sampler` are P_H and Q_H; `tail_ratio` is ρ.
    """

    token_weight: Tensor
    head_coef: Tensor
    head_mass_trainer: Tensor
    head_mass_sampler: Tensor
    tail_ratio: Tensor


def gather_head_logprobs(vocab_logprobs: Tensor, head_ids: Tensor) -> Tensor:
    """Trainer log-probs [B, T, K] of the sampler's head ids; padding ids (< 0) give 0.

    Gradients flow into `vocab_logprobs` [B, T, V] for the real ids only.
    """
    valid = head_ids >= 0
    safe_ids = torch.where(valid, head_ids, torch.zeros_like(head_ids)).long()
    gathered = torch.gather(vocab_logprobs, -1, safe_ids)
    return torch.where(valid, gathered, torch.zeros_like(gathered))


def centering_terms(
    token_logprobs: Tensor,
    head_logprobs: Tensor,
    sampler_logprobs: Tensor,
    sampler_head_logprobs: Tensor,
    head_valid: Tensor,
    active: Tensor,
    weighting: Correction = "mis",
    *,
    tis_cap: float = TIS_CAP,
    mis_low: float = MIS_LOW,
    mis_high: float = MIS_HIGH,
) -> CenteringTerms:
    """Compute w_t and the head coefficients c_v under the proportional-tail model.

    P_H = Σ_H p_v, Q_H = Σ_H q_v (heads not renormalised); ρ = max(1−Q_H, 1e-6) /
    max(1−P_H, 1e-6); the sampler tail is modelled as ρ·p_v, giving α = ρ·f(1/ρ) and
    c_v = q_v·f(p_v/q_v) − α·p_v in closed form (none: q, ρ; tis: min(p, c·q), min(1, c·ρ);
    mis: p·1[L ≤ p/q ≤ U], 1[1/U ≤ ρ ≤ 1/L]). p is the *current* trainer, detached; q is
    what the sampler recorded. Tokens where `active` is false (masked, or zero advantage)
    get zero coefficients; a NaN among an active token's head entries is an error.
    """
    _check_band(weighting, tis_cap, mis_low, mis_high)
    act = active.to(torch.bool)
    valid = head_valid.to(torch.bool) & act.unsqueeze(-1)
    lp = head_logprobs.detach()
    lq = sampler_head_logprobs.detach()
    if torch.isnan(lq[valid]).any() or torch.isnan(lp[valid]).any():
        raise InvalidLossInput(
            "sampler or trainer head log-probs are NaN on an active token; check the "
            "recorded top-k log-probs (padding must use id -1)"
        )
    p = torch.where(valid, lp.exp(), torch.zeros_like(lp))
    q = torch.where(valid, lq.exp(), torch.zeros_like(lq))
    head_p = p.sum(dim=-1)
    head_q = q.sum(dim=-1)
    rho = (1.0 - head_q).clamp_min(TAIL_FLOOR) / (1.0 - head_p).clamp_min(TAIL_FLOOR)

    if weighting == "none":
        q_f = q
        alpha = rho
    elif weighting == "tis":
        q_f = torch.minimum(p, tis_cap * q)
        alpha = (tis_cap * rho).clamp(max=1.0)
    else:
        log_r = lp - lq
        keep = valid & (log_r >= math.log(mis_low)) & (log_r <= math.log(mis_high))
        q_f = torch.where(keep, p, torch.zeros_like(p))
        alpha = ((rho >= 1.0 / mis_high) & (rho <= 1.0 / mis_low)).to(rho.dtype)
    coef = torch.where(valid, q_f - alpha.unsqueeze(-1) * p, torch.zeros_like(p))

    token_log_ratio = token_logprobs.detach() - sampler_logprobs.detach()
    w = weight_from_log_ratio(
        token_log_ratio, weighting, tis_cap=tis_cap, mis_low=mis_low, mis_high=mis_high
    )
    w = torch.where(act, w, torch.zeros_like(w))
    return CenteringTerms(
        token_weight=w,
        head_coef=coef,
        head_mass_trainer=head_p,
        head_mass_sampler=head_q,
        tail_ratio=rho,
    )


def score_centered_loss(
    vocab_logprobs: Tensor,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    sampler_topk_ids: Tensor,
    sampler_topk_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weighting: Correction = "mis",
    *,
    tis_cap: float = TIS_CAP,
    mis_low: float = MIS_LOW,
    mis_high: float = MIS_HIGH,
    centering: bool = True,
    normalization: Normalization = "token",
) -> LossOutput:
    """Score-centred REINFORCE loss over a sampler top-K head with a proportional tail.

    Per token: ℓ_t = −A_t·[w_t·log p_θ(a_t) − Σ_{v∈H_t} c_v·log p_θ(v)], so
    −∇ℓ_t = A_t·(w_t·s(a_t) − μ̂_w): the expected score under the sampler is subtracted and
    the drift toward q vanishes. No PPO ratio or clip.

    Args:
        vocab_logprobs: [B, T, V] current trainer log-softmax(logits / T), with grad.
        tokens: [B, T] sampled token ids a_t.
        sampler_logprobs: [B, T] recorded log q(a_t) (used even when a_t is not in the head).
        sampler_topk_ids: [B, T, K] sampler head ids; -1 pads short rows.
        sampler_topk_logprobs: [B, T, K] recorded log q of the head (padding: -inf or any).
        advantages: [B] or [B, T], detached.
        mask: [B, T] trainable positions.
        weighting: f — "none", "tis" (cap `tis_cap`) or "mis" (band [mis_low, mis_high]).
        centering: False drops the Σ c·log p term (ablation) but keeps w_t.
        normalization: "token" (the recipe) or "sequence"; see `reduce_masked`.

    Metrics: `sc_correction`, `sc_train_head_mass`, `sc_rollout_head_mass`,
    `sc_tail_ratio`, `sc_importance_weight`, `sc_masked_fraction`, plus the gap metrics.
    """
    from trainer_client.gap_metrics import gap_metrics

    if vocab_logprobs.dim() != 3:
        raise InvalidLossInput(
            f"vocab_logprobs must be [B, T, V], got shape {tuple(vocab_logprobs.shape)}"
        )
    _check_same_shape(tokens=tokens, sampler_logprobs=sampler_logprobs, mask=mask)
    _check_same_shape(
        sampler_topk_ids=sampler_topk_ids, sampler_topk_logprobs=sampler_topk_logprobs
    )
    if tuple(tokens.shape) != tuple(vocab_logprobs.shape[:2]):
        raise InvalidLossInput(
            f"tokens {tuple(tokens.shape)} must match vocab_logprobs' first two dims "
            f"{tuple(vocab_logprobs.shape[:2])}"
        )
    m = mask.to(torch.bool)
    a = _token_advantages(advantages, mask.to(vocab_logprobs.dtype))
    active = m & (a != 0)
    token_logprobs = torch.gather(vocab_logprobs, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    head_logprobs = gather_head_logprobs(vocab_logprobs, sampler_topk_ids)
    head_valid = sampler_topk_ids >= 0
    terms = centering_terms(
        token_logprobs,
        head_logprobs,
        sampler_logprobs,
        torch.where(head_valid, sampler_topk_logprobs, torch.zeros_like(sampler_topk_logprobs)),
        head_valid,
        active,
        weighting,
        tis_cap=tis_cap,
        mis_low=mis_low,
        mis_high=mis_high,
    )
    per_token = score_centered_surrogate(
        token_logprobs, head_logprobs, terms, a, centering=centering
    )
    loss = reduce_masked(per_token, m, normalization)

    nonzero = terms.head_coef != 0
    if not torch.isfinite(head_logprobs.detach()[nonzero]).all():
        raise InvalidLossInput("trainer log-prob is not finite where a centering coefficient is")
    correction = (terms.head_coef * torch.where(nonzero, head_logprobs.detach(), 0.0)).sum(-1)
    metrics = {
        "sc_correction": _masked_mean(correction, m),
        "sc_train_head_mass": _masked_mean(terms.head_mass_trainer, active),
        "sc_rollout_head_mass": _masked_mean(terms.head_mass_sampler, active),
        "sc_tail_ratio": _masked_mean(terms.tail_ratio, active),
        "sc_importance_weight": _masked_mean(terms.token_weight, active),
    }
    gap = gap_metrics(
        token_logprobs.detach(), sampler_logprobs, m, mis_low=mis_low, mis_high=mis_high
    )
    metrics.update(gap.as_dict())
    return LossOutput(loss=loss, metrics=metrics)


def score_centered_surrogate(
    token_logprobs: Tensor,
    head_logprobs: Tensor,
    terms: CenteringTerms,
    advantages: Tensor,
    *,
    centering: bool = True,
) -> Tensor:
    """Per-token surrogate −A·(w·log p(a) − Σ c·log p(v)) [B, T], unreduced.

    The only differentiable inputs are `token_logprobs` [B, T] and `head_logprobs`
    [B, T, K]; head entries whose coefficient is 0 are excluded so 0·(−inf) never occurs.
    """
    a = _token_advantages(advantages, token_logprobs)
    sampled = terms.token_weight * token_logprobs
    if not centering:
        return -a * sampled
    nonzero = terms.head_coef != 0
    scored = torch.where(nonzero, head_logprobs, torch.zeros_like(head_logprobs))
    correction = (terms.head_coef * scored).sum(dim=-1)
    return -a * (sampled - correction)
