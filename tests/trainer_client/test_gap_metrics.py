"""Specification of the sampler/trainer gap metrics (spec §6.7, §9)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer_client.gap_metrics import gap_metrics, head_mass


@pytest.mark.parametrize("seed", range(4))
def test_gap_metrics_match_numpy_on_the_masked_tokens(seed):
    rng = np.random.default_rng(seed)
    q = -rng.uniform(0.1, 4, size=(4, 9))
    p = q + rng.normal(0, 1.0, size=q.shape)
    mask = rng.uniform(size=q.shape) > 0.3
    got = gap_metrics(torch.tensor(p), torch.tensor(q), torch.tensor(mask))
    d = (p - q)[mask]
    assert got.tokens == mask.sum()
    assert got.logprob_abs_diff == pytest.approx(np.abs(d).mean())
    assert got.k3_kl == pytest.approx(np.mean(np.exp(d) - 1 - d))
    outside = (np.exp(d) < 0.5) | (np.exp(d) > 5.0)
    assert got.masked_fraction == pytest.approx(outside.mean())


def test_identical_policies_have_no_gap():
    lp = torch.log(torch.rand(3, 5))
    got = gap_metrics(lp, lp.clone(), torch.ones(3, 5))
    assert (got.logprob_abs_diff, got.k3_kl, got.masked_fraction) == (0.0, 0.0, 0.0)


def test_k3_kl_is_non_negative_and_clamped():
    q = torch.zeros(1, 4)
    p = torch.tensor([[-30.0, 30.0, 0.5, -0.5]])
    got = gap_metrics(p, q, torch.ones(1, 4))
    assert 0.0 <= got.k3_kl <= 10.0
    assert got.k3_kl == 10.0  # exp(20) dominates: clamped


def test_empty_mask_reports_zeros_not_nan():
    got = gap_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert got.as_dict() == {
        "gap_logprob_abs_diff": 0.0,
        "gap_k3_kl": 0.0,
        "gap_masked_fraction": 0.0,
        "gap_tokens": 0.0,
    }


def test_head_mass_sums_valid_head_probabilities_over_masked_tokens():
    head = torch.log(torch.tensor([[[0.5, 0.25, 0.9], [0.1, 0.1, 0.9]]]))
    valid = torch.tensor([[[True, True, False], [True, True, False]]])
    assert head_mass(head, valid, torch.tensor([[1, 0]])) == pytest.approx(0.75)
    got = gap_metrics(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        trainer_head_logprobs=head,
        sampler_head_logprobs=head - np.log(2),
        head_valid=valid,
    )
    assert got.trainer_head_mass == pytest.approx((0.75 + 0.2) / 2)
    assert got.sampler_head_mass == pytest.approx((0.75 + 0.2) / 4)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        gap_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
