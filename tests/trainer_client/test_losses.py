"""Specification of trainer_client.losses against plain numpy references (spec §2–§8)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer_client.losses import (
    InvalidLossInput,
    centering_terms,
    grpo_advantages,
    importance_weights,
    policy_loss,
    reduce_masked,
    score_centered_loss,
    score_centered_surrogate,
)

SEEDS = range(6)


# ----------------------------------------------------------------- numpy references


def np_grpo(rewards: np.ndarray, group_size: int, normalize_std: bool) -> np.ndarray:
    out = np.empty_like(rewards)
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        centred = group - group.mean()
        if normalize_std and group_size > 1:
            std = group.std(ddof=1)
            if std > 0:
                centred = centred / (std + 1e-6)
        out[start : start + group_size] = centred
    return out


def np_f(ratio: np.ndarray, correction: str, cap=2.0, low=0.5, high=5.0) -> np.ndarray:
    if correction == "none":
        return np.ones_like(ratio)
    if correction == "tis":
        return np.minimum(ratio, cap)
    return np.where((ratio >= low) & (ratio <= high), ratio, 0.0)


def np_reduce(x: np.ndarray, mask: np.ndarray, normalization: str) -> float:
    per_seq = np.maximum(mask.sum(-1), 1.0)
    if normalization == "token":
        return float((x * mask).sum() / per_seq.sum())
    return float(((x * mask).sum(-1) / per_seq).mean())


def np_policy_loss(lp, old, q, adv, mask, correction, level, normalization, eps=0.2):
    delta = (old - q) * mask
    if level == "token":
        level_delta = delta
    elif level == "sequence":
        level_delta = np.repeat(delta.sum(-1, keepdims=True), lp.shape[1], axis=1)
    else:
        mean = delta.sum(-1, keepdims=True) / np.maximum(mask.sum(-1, keepdims=True), 1)
        level_delta = np.repeat(mean, lp.shape[1], axis=1)
    w = np_f(np.exp(level_delta), correction) * mask
    r = np.exp(lp - old)
    a = adv[:, None]
    per_token = np.maximum(-r * a, -np.clip(r, 1 - eps, 1 + eps) * a) * w
    return np_reduce(per_token, mask, normalization)


def np_sc_closed_form(p, q, f, cap=2.0, low=0.5, high=5.0):
    """Closed-form q·f(p/q) and α of the spec's table, from head probabilities."""
    rho = max(1 - q.sum(), 1e-6) / max(1 - p.sum(), 1e-6)
    if f == "none":
        return q, rho
    if f == "tis":
        return np.minimum(p, cap * q), min(1.0, cap * rho)
    keep = (p / q >= low) & (p / q <= high)
    return np.where(keep, p, 0.0), float(1 / high <= rho <= 1 / low)


def np_sc_dense_logit_grad(z, q_full, head, a, adv, f):
    """−∇_z of one token's loss densely: A·(w·s_a − Σ_v q̂_v f(p_v/q̂_v) s_v), s_v = e_v − p."""
    p = np.exp(z - z.max())
    p /= p.sum()
    in_head = np.zeros(len(z), dtype=bool)
    in_head[head] = True
    rho = max(1 - q_full[in_head].sum(), 1e-6) / max(1 - p[in_head].sum(), 1e-6)
    q_hat = np.where(in_head, q_full, rho * p)
    scores = np.eye(len(z)) - p[None, :]
    mu = (q_hat * np_f(p / q_hat, f))[:, None] * scores
    w = np_f(np.array([p[a] / q_full[a]]), f)[0]
    return -adv * (w * scores[a] - mu.sum(0))


# ----------------------------------------------------------------- GRPO


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize_std", [False, True])
def test_grpo_advantages_match_numpy_group_mean_and_unbiased_std(seed, normalize_std):
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 3, size=24).astype(np.float64)
    rewards[:4] = 1.0  # one group with zero spread stays at zero
    got = grpo_advantages(torch.tensor(rewards), 4, normalize_std=normalize_std)
    np.testing.assert_allclose(got.numpy(), np_grpo(rewards, 4, normalize_std), atol=1e-12)
    assert torch.all(got[:4] == 0)


def test_grpo_groups_of_one_have_zero_advantage_even_with_std_normalisation():
    got = grpo_advantages(torch.tensor([1.0, 5.0, -2.0]), 1, normalize_std=True)
    assert torch.equal(got, torch.zeros(3, dtype=got.dtype))


def test_grpo_rejects_rewards_that_do_not_split_into_groups():
    with pytest.raises(InvalidLossInput, match="groups of 4"):
        grpo_advantages(torch.ones(6), 4)


# ----------------------------------------------------------------- policy loss (TIS / MIS)


def _batch(seed, b=5, t=7, spread=1.0):
    rng = np.random.default_rng(seed)
    q = -rng.uniform(0.1, 3.0, size=(b, t))
    old = q + rng.normal(0, spread, size=(b, t))
    lp = old + rng.normal(0, 0.3, size=(b, t))
    adv = rng.normal(size=b)
    mask = (rng.uniform(size=(b, t)) > 0.25).astype(np.float64)
    mask[0] = 0.0  # an all-padding sequence must not divide by zero
    return lp, old, q, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_policy_loss_matches_numpy_reference(seed, correction, level, normalization):
    lp, old, q, adv, mask = _batch(seed, spread=0.4 if level == "token" else 0.15)
    out = policy_loss(
        torch.tensor(lp),
        torch.tensor(q),
        torch.tensor(adv),
        torch.tensor(mask),
        correction,
        old_logprobs=torch.tensor(old),
        level=level,
        normalization=normalization,
    )
    want = np_policy_loss(lp, old, q, adv, mask, correction, level, normalization)
    assert out.loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_policy_loss_without_old_logprobs_is_corrected_reinforce():
    lp, _, q, adv, mask = _batch(1)
    logprobs = torch.tensor(lp, requires_grad=True)
    out = policy_loss(logprobs, torch.tensor(q), torch.tensor(adv), torch.tensor(mask), "tis")
    out.loss.backward()
    w = np.minimum(np.exp(lp - q), 2.0) * mask
    expected_grad = -w * adv[:, None] / np.maximum(mask.sum(-1), 1).sum()
    np.testing.assert_allclose(logprobs.grad.numpy(), expected_grad, atol=1e-12)
    assert out.metrics["pg_clipfrac"] == 0.0
    assert out.metrics["ppo_kl"] == 0.0


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_policy_loss_gradient_passes_gradcheck(correction):
    lp, old, q, adv, mask = _batch(3, b=3, t=4)
    lp = old + np.random.default_rng(3).uniform(-0.1, 0.1, size=lp.shape)  # inside the clip

    def loss(x):
        return policy_loss(
            x,
            torch.tensor(q),
            torch.tensor(adv),
            torch.tensor(mask),
            correction,
            old_logprobs=torch.tensor(old),
        ).loss

    assert torch.autograd.gradcheck(loss, (torch.tensor(lp, requires_grad=True),))


def test_tis_caps_the_weight_at_two_and_has_no_lower_clip():
    q = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[0.01, 1.5, 2.0, 50.0]]))
    w = importance_weights(old, q, torch.ones(1, 4), "tis")
    torch.testing.assert_close(w, torch.tensor([[0.01, 1.5, 2.0, 2.0]]))


def test_mis_zeroes_tokens_outside_the_band_and_keeps_those_inside():
    q = torch.zeros(1, 6)
    ratios = torch.tensor([[0.49, 0.5, 1.0, 4.9, 5.0, 5.1]], dtype=torch.float64)
    w = importance_weights(ratios.log(), q.double(), torch.ones(1, 6), "mis")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 4.9, 5.0, 0.0]]).double())


def test_sequence_level_mis_drops_whole_sequences_outside_the_band():
    q = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.log(torch.tensor([[2.0, 2.0, 2.0], [1.5, 1.0, 1.0]], dtype=torch.float64))
    mask = torch.ones(2, 3)
    w = importance_weights(old, q, mask, "mis", level="sequence")
    assert torch.all(w[0] == 0)  # product 8 > 5
    torch.testing.assert_close(w[1], torch.full((3,), 1.5, dtype=torch.float64))


def test_mis_dropped_tokens_stay_in_the_denominator():
    q = torch.zeros(2, 4, dtype=torch.float64)
    old = torch.log(torch.tensor([[1.0, 9.0, 1.0, 0.1], [1.0, 1.0, 1.0, 1.0]]).double())
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    for normalization, want in (("token", -(2 + 2) / 6), ("sequence", -(2 / 4 + 2 / 2) / 2)):
        out = policy_loss(old.clone(), q, adv, mask, "mis", normalization=normalization)
        assert out.loss.item() == pytest.approx(want)
    assert out.metrics["mis_masked_fraction"] == pytest.approx(2 / 6)


def test_reduce_masked_denominators_ignore_the_values():
    values = torch.tensor([[1.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert reduce_masked(values, mask, "token").item() == pytest.approx(1 / 3)
    assert reduce_masked(values, mask, "sequence").item() == pytest.approx((1 / 2 + 0) / 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"correction": "mis", "mis_low": 2.0, "mis_high": 1.0}, "MIS band"),
        ({"correction": "tis", "tis_cap": 0.0}, "TIS cap"),
        ({"correction": "bogus"}, "correction must be"),
    ],
)
def test_policy_loss_rejects_bad_hyper_parameters(kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(InvalidLossInput, match=match):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), **kwargs)


def test_policy_loss_rejects_nan_advantages_and_mismatched_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(InvalidLossInput, match="NaN"):
        policy_loss(x, x, torch.tensor([1.0, math.nan]), torch.ones(2, 3))
    with pytest.raises(InvalidLossInput, match="one shape"):
        policy_loss(x, torch.zeros(2, 4), torch.ones(2), torch.ones(2, 3))


# ----------------------------------------------------------------- score centering


def _sc_batch(seed, b=3, t=4, v=12, k=4, gap=0.7):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    sampler_logits = logits + gap * torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    q_full = torch.log_softmax(sampler_logits, -1)
    tokens = torch.multinomial(q_full.exp().reshape(-1, v), 1, generator=gen).reshape(b, t)
    head = torch.topk(q_full, k, dim=-1).indices
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t)
    mask[-1, -2:] = 0
    return logits, q_full, tokens, head, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weighting", ["none", "tis", "mis"])
def test_score_centered_gradient_equals_dense_proportional_tail_reference(seed, weighting):
    logits, q_full, tokens, head, adv, mask = _sc_batch(seed)
    head[0, 0, -1] = -1  # a padded head entry contributes nothing
    z = logits.clone().requires_grad_(True)
    q_tok = q_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_head = torch.where(head >= 0, q_full.gather(-1, head.clamp_min(0)), -math.inf)
    out = score_centered_loss(
        torch.log_softmax(z, -1), tokens, q_tok, head, q_head, adv, mask, weighting
    )
    out.loss.backward()

    b, t, _ = logits.shape
    expected = np.zeros(logits.shape)
    count = mask.sum().item()
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                ids = [h for h in head[i, j].tolist() if h >= 0]
                expected[i, j] = (
                    np_sc_dense_logit_grad(
                        logits[i, j].numpy(),
                        q_full[i, j].exp().numpy(),
                        ids,
                        int(tokens[i, j]),
                        adv[i].item(),
                        weighting,
                    )
                    / count
                )
    np.testing.assert_allclose(z.grad.numpy(), expected, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weighting", ["none", "tis", "mis"])
def test_centering_coefficients_match_the_closed_forms(seed, weighting):
    logits, q_full, tokens, head, _, mask = _sc_batch(seed, gap=1.5)
    lp_full = torch.log_softmax(logits, -1)
    lp_head = lp_full.gather(-1, head)
    lq_head = q_full.gather(-1, head)
    lp_tok = lp_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    lq_tok = q_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    active = torch.ones_like(mask, dtype=torch.bool)
    terms = centering_terms(lp_tok, lp_head, lq_tok, lq_head, head >= 0, active, weighting)
    for i, j in np.ndindex(*mask.shape):
        p, q = lp_head[i, j].exp().numpy(), lq_head[i, j].exp().numpy()
        q_f, alpha = np_sc_closed_form(p, q, weighting)
        np.testing.assert_allclose(terms.head_coef[i, j].numpy(), q_f - alpha * p, atol=1e-12)
        ratio = np.exp((lp_tok[i, j] - lq_tok[i, j]).item())
        assert terms.token_weight[i, j].item() == pytest.approx(
            np_f(np.array([ratio]), weighting)[0], rel=1e-12
        )


@pytest.mark.parametrize("weighting", ["none", "tis", "mis"])
def test_full_vocabulary_head_makes_the_expected_centered_gradient_zero(weighting):
    v = 9
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(v, generator=gen, dtype=torch.float64)
    q = torch.log_softmax(z + 0.8 * torch.randn(v, generator=gen, dtype=torch.float64), -1)
    # One row per possible sampled token a, weighted by q(a): the loss is E_{a~q}[ℓ_a].
    tokens = torch.arange(v).unsqueeze(0)
    head = torch.arange(v).expand(1, v, v)
    weights = q.exp().unsqueeze(0)

    def expected_grad(centering):
        logits = z.clone().requires_grad_(True)
        lp = torch.log_softmax(logits, -1).expand(1, v, v)
        out = score_centered_loss(
            lp,
            tokens,
            q.unsqueeze(0),
            head,
            q.expand(1, v, v),
            weights,
            torch.ones(1, v),
            weighting,
            centering=centering,
        )
        out.loss.backward()
        return logits.grad

    assert torch.allclose(expected_grad(True), torch.zeros(v, dtype=torch.float64), atol=1e-12)
    if weighting != "mis":  # uncentered, the drift toward q is real
        assert expected_grad(False).abs().max() > 1e-3


def test_score_centered_surrogate_passes_gradcheck():
    logits, q_full, tokens, head, adv, mask = _sc_batch(5, b=2, t=3, v=6, k=3)
    lp_full = torch.log_softmax(logits, -1)
    lp_tok = lp_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    lp_head = lp_full.gather(-1, head)
    terms = centering_terms(
        lp_tok,
        lp_head,
        q_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        q_full.gather(-1, head),
        head >= 0,
        mask.bool(),
        "tis",
    )
    inputs = (lp_tok.clone().requires_grad_(True), lp_head.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(
        lambda t, h: score_centered_surrogate(t, h, terms, adv).sum(), inputs
    )


def test_score_centering_ignores_tokens_with_zero_advantage_or_no_mask():
    logits, q_full, tokens, head, _, mask = _sc_batch(2)
    adv = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    q_tok = q_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_head = q_full.gather(-1, head)
    q_head[0] = math.nan  # NaN on an inactive token is harmless
    z = logits.clone().requires_grad_(True)
    out = score_centered_loss(torch.log_softmax(z, -1), tokens, q_tok, head, q_head, adv, mask)
    out.loss.backward()
    assert torch.all(z.grad[0] == 0)
    assert torch.all(z.grad[2, -2:] == 0)
    assert math.isfinite(out.loss.item())


def test_score_centering_refuses_nan_on_an_active_token():
    logits, q_full, tokens, head, adv, mask = _sc_batch(4)
    q_head = q_full.gather(-1, head)
    q_head[1, 0, 0] = math.nan
    q_tok = q_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with pytest.raises(InvalidLossInput, match="NaN on an active token"):
        score_centered_loss(torch.log_softmax(logits, -1), tokens, q_tok, head, q_head, adv, mask)


def test_score_centering_reports_head_masses_and_tail_ratio():
    logits, q_full, tokens, head, adv, mask = _sc_batch(6, k=12)  # head = full vocab
    q_tok = q_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    out = score_centered_loss(
        torch.log_softmax(logits, -1), tokens, q_tok, head, q_full.gather(-1, head), adv, mask
    )
    assert out.metrics["sc_train_head_mass"] == pytest.approx(1.0)
    assert out.metrics["sc_rollout_head_mass"] == pytest.approx(1.0)
    assert out.metrics["sc_tail_ratio"] == pytest.approx(1.0)
    assert out.metrics["gap_tokens"] == mask.sum().item()
