"""Specification of the named correction presets, each against its own numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.trainer_client.test_losses import _sc_batch, np_sc_dense_logit_grad
from trainer_client.correction_presets import PRESETS, correction_preset
from trainer_client.losses import InvalidLossInput

SEEDS = range(4)


def _policy_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    b, t = 5, 7
    q = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    # Gaps large enough that every band is crossed by some tokens and some sequences.
    old = q + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.6
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, -3:] = 0
    mask[3, -1:] = 0
    return old, q, adv, mask


def np_preset_loss(name: str, old, q, adv, mask) -> float:
    """The recipe written out per name; on-policy anchor, so the loss is −Σ w·A / Σ m."""
    delta = (old - q) * mask
    tokens = mask.sum(-1, keepdims=True)
    if name == "token-tis":
        w = np.minimum(np.exp(delta), 2.0)
    elif name == "sequence-mis":
        rho = np.exp(delta.sum(-1, keepdims=True))
        w = np.broadcast_to(np.where((rho >= 0.5) & (rho <= 2.0), rho, 0.0), delta.shape)
    elif name == "geometric-mask":
        rho = np.exp(delta.sum(-1, keepdims=True) / np.maximum(tokens, 1))
        w = np.broadcast_to(np.where((rho >= 0.5) & (rho <= 2.0), rho, 0.0), delta.shape)
    else:
        raise AssertionError(name)
    return float((-(w * adv[:, None]) * mask).sum() / np.maximum(tokens, 1).sum())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["token-tis", "sequence-mis", "geometric-mask"])
def test_policy_presets_match_their_numpy_recipe(seed, name):
    old, q, adv, mask = _policy_batch(seed)
    out = correction_preset(name).policy_loss(old, q, adv, mask)
    expected = np_preset_loss(name, old.numpy(), q.numpy(), adv.numpy(), mask.numpy())
    assert out.loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_presets_differ_where_their_rules_differ():
    old, q, adv, mask = _policy_batch(0)
    losses = {
        n: correction_preset(n).policy_loss(old, q, adv, mask).loss.item()
        for n in PRESETS
        if n != "score-centering-mis"
    }
    assert len({round(v, 12) for v in losses.values()}) == len(losses)


def test_sequence_mis_drops_a_whole_sequence_that_geometric_masking_keeps():
    # Ten tokens each 1.1× likelier under the trainer: the product (2.59) leaves the band,
    # the geometric mean (1.1) does not.
    q = torch.full((1, 10), -1.0, dtype=torch.float64)
    old = q + math.log(1.1)
    adv = torch.ones(1, dtype=torch.float64)
    mask = torch.ones(1, 10, dtype=torch.float64)
    assert correction_preset("sequence-mis").policy_loss(old, q, adv, mask).loss.item() == 0.0
    geometric = correction_preset("geometric-mask").policy_loss(old, q, adv, mask)
    assert geometric.loss.item() == pytest.approx(-1.1)


@pytest.mark.parametrize("seed", range(3))
def test_score_centering_mis_preset_matches_the_dense_numpy_gradient(seed):
    logits, q_full, tokens, head, adv, mask = _sc_batch(seed)
    z = logits.clone().requires_grad_(True)
    q_tok = q_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_head = q_full.gather(-1, head)
    out = correction_preset("score-centering-mis").score_centered_loss(
        torch.log_softmax(z, -1), tokens, q_tok, head, q_head, adv, mask
    )
    out.loss.backward()
    b, t, _ = logits.shape
    count = mask.sum().item()
    expected = np.zeros(logits.shape)
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                expected[i, j] = (
                    np_sc_dense_logit_grad(
                        logits[i, j].numpy(),
                        q_full[i, j].exp().numpy(),
                        head[i, j].tolist(),
                        int(tokens[i, j]),
                        adv[i].item(),
                        "mis",
                    )
                    / count
                )
    np.testing.assert_allclose(z.grad.numpy(), expected, atol=1e-10)


def test_an_unknown_preset_name_lists_the_known_ones():
    with pytest.raises(InvalidLossInput, match="token-tis, sequence-mis"):
        correction_preset("icepop2")


def test_a_preset_refuses_the_loss_it_is_not_for():
    old, q, adv, mask = _policy_batch(0)
    with pytest.raises(InvalidLossInput, match="score_centered_loss"):
        correction_preset("score-centering-mis").policy_loss(old, q, adv, mask)
