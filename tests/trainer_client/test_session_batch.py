"""Session trajectories become the losses' tensors, aligned for next-token prediction."""

from __future__ import annotations

import pytest
import torch

from trainer_client.losses import policy_loss
from trainer_client.session_batch import next_token_logprobs, session_batch


def _trajectory(ids: list[int], mask: list[int], logprobs: list[float]) -> dict:
    return {
        "session_id": "s",
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "prompt_length": mask.index(1) if 1 in mask else len(mask),
    }


def test_only_sampled_tokens_train_and_their_sampler_logprobs_sit_one_position_earlier() -> None:
    # prompt 1 2 | sampled 3 4 | tool 5 | sampled 6
    first = _trajectory([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], [0, 0, -0.1, -0.2, 0, -0.3])
    second = _trajectory([1, 9, 8], [0, 1, 1], [0, -0.5, -0.6])
    batch = session_batch([first, second], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 9, 8, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    assert batch.mask.tolist() == [[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]]
    assert batch.sampler_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, 0, -0.3])
    assert batch.prompt_lengths == [2, 1]

    logits = torch.randn(2, 6, 12, requires_grad=True)
    logprobs = next_token_logprobs(logits, batch.input_ids)
    assert logprobs.shape == batch.mask.shape
    advantages = torch.tensor([1.0, -1.0])
    # No behaviour correction: random logits are far from the sampler's, MIS would drop all.
    out = policy_loss(logprobs, batch.sampler_logprobs, advantages, batch.mask, "none")
    out.loss.backward()
    assert logits.grad is not None
    # Positions whose next token the model did not sample get no gradient.
    assert torch.all(logits.grad[0, 0] == 0) and torch.all(logits.grad[0, 3] == 0)
    assert torch.any(logits.grad[0, 1] != 0)


def test_a_trajectory_whose_lists_disagree_is_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        session_batch([_trajectory([1, 2], [0], [0.0, 0.0])])
