"""Named correction presets: the recipes practitioners ask for by name, over `losses`.

A preset fixes which loss runs (the corrected policy loss or the score-centred one), the
correction (TIS or MIS), the level its ratio is taken at and the band, so a trainer or an
integration selects a whole recipe with one string:

- `token-tis`: token-level truncated IS (Miles/slime `--use-tis`): min(ρ_t, 2), policy loss;
- `sequence-mis`: sequence-level masked IS (`mis.py`, level sequence): ρ·1[0.5 ≤ ρ ≤ 2] with
  ρ the product over the sequence, policy loss;
- `geometric-mask`: geometric-mean masking (`mis.py`, level geometric): the same band on the
  geometric mean of the token ratios, policy loss;
- `score-centering-mis`: score centering with MIS (the SC recipe): ρ_t·1[0.5 ≤ ρ_t ≤ 5],
  score-centred loss.

This module owns the table and the dispatch only; the formulas live in `losses` and are
never re-derived here. It must never choose a preset for the caller or read configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from trainer_client.losses import (
    MIS_HIGH,
    MIS_LOW,
    TIS_CAP,
    Correction,
    InvalidLossInput,
    LossOutput,
    Normalization,
    RatioLevel,
    policy_loss,
    score_centered_loss,
)

LossKind = Literal["policy", "score_centering"]

#: The `mis.py` / IcePop band's upper bound (spec §5.1–5.2); SC's MIS keeps `MIS_HIGH`.
MIS_PY_HIGH = 2.0


@dataclass(frozen=True)
class CorrectionPreset:
    """One named recipe: which loss, which correction, at which level, with which band."""

    name: str
    loss: LossKind
    correction: Correction
    level: RatioLevel = "token"
    tis_cap: float = TIS_CAP
    mis_low: float = MIS_LOW
    mis_high: float = MIS_HIGH

    def policy_loss(
        self,
        logprobs: Tensor,
        sampler_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        old_logprobs: Tensor | None = None,
        normalization: Normalization = "token",
    ) -> LossOutput:
        """`losses.policy_loss` with this preset's correction, level and band."""
        if self.loss != "policy":
            raise InvalidLossInput(
                f"preset {self.name!r} is a score-centring recipe: call score_centered_loss "
                "with the sampler's top-k head instead of policy_loss"
            )
        return policy_loss(
            logprobs,
            sampler_logprobs,
            advantages,
            mask,
            self.correction,
            old_logprobs=old_logprobs,
            level=self.level,
            tis_cap=self.tis_cap,
            mis_low=self.mis_low,
            mis_high=self.mis_high,
            normalization=normalization,
        )

    def score_centered_loss(
        self,
        vocab_logprobs: Tensor,
        tokens: Tensor,
        sampler_logprobs: Tensor,
        sampler_topk_ids: Tensor,
        sampler_topk_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        normalization: Normalization = "token",
    ) -> LossOutput:
        """`losses.score_centered_loss` with this preset's weighting and band."""
        if self.loss != "score_centering":
            raise InvalidLossInput(
                f"preset {self.name!r} is a policy-loss recipe: call policy_loss instead"
            )
        return score_centered_loss(
            vocab_logprobs,
            tokens,
            sampler_logprobs,
            sampler_topk_ids,
            sampler_topk_logprobs,
            advantages,
            mask,
            self.correction,
            tis_cap=self.tis_cap,
            mis_low=self.mis_low,
            mis_high=self.mis_high,
            normalization=normalization,
        )


PRESETS: dict[str, CorrectionPreset] = {
    p.name: p
    for p in (
        CorrectionPreset("token-tis", "policy", "tis", "token"),
        CorrectionPreset("sequence-mis", "policy", "mis", "sequence", mis_high=MIS_PY_HIGH),
        CorrectionPreset("geometric-mask", "policy", "mis", "geometric", mis_high=MIS_PY_HIGH),
        CorrectionPreset("score-centering-mis", "score_centering", "mis", "token"),
    )
}


def correction_preset(name: str) -> CorrectionPreset:
    """The preset called `name`; an unknown name is an error that lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidLossInput(
            f"unknown correction preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
