"""Agent-session trajectories (`GET /v1/sessions/{id}/trajectory`) as the losses' tensors.

Owns `session_batch`: B trajectories → padded token ids and, aligned for next-token
prediction, the loss mask and the sampler's logprobs. Position t of the [B, L-1] tensors
scores token t+1, so

    logprobs = next_token_logprobs(model(batch.input_ids).logits, batch.input_ids)
    out = policy_loss(logprobs, batch.sampler_logprobs, advantages, batch.mask)

Tool results, user turns and padding have mask 0; only tokens the engine sampled train.
Pure torch over the trajectory JSON (or `wire.Trajectory`); never talks to the control
plane and never re-tokenizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from wire import Trajectory


@dataclass(frozen=True)
class SessionBatch:
    input_ids: Tensor  # [B, L] long, padded with `pad_id` on the right
    attention_mask: Tensor  # [B, L] long: 1 on real tokens
    mask: Tensor  # [B, L-1] float32: 1 where token t+1 was sampled by the model
    sampler_logprobs: Tensor  # [B, L-1] float32: the sampler's logprob of token t+1
    prompt_lengths: list[int]  # tokens of each episode's first prompt


Row = tuple[list[int], list[int], list[float], int]


def _fields(trajectory: Trajectory | Mapping[str, Any]) -> Row:
    data = trajectory.model_dump() if isinstance(trajectory, Trajectory) else trajectory
    ids, mask, logprobs = data["token_ids"], data["loss_mask"], data["logprobs"]
    if not len(ids) == len(mask) == len(logprobs):
        raise ValueError(
            f"trajectory {data.get('session_id')!r}: token_ids, loss_mask and logprobs differ "
            f"in length ({len(ids)}, {len(mask)}, {len(logprobs)}); fetch it again"
        )
    return list(ids), list(mask), list(logprobs), int(data.get("prompt_length", 0))


def session_batch(
    trajectories: Sequence[Trajectory | Mapping[str, Any]], pad_id: int = 0
) -> SessionBatch:
    """Pad `trajectories` into one batch (at least one, each with two tokens or more)."""
    if not trajectories:
        raise ValueError("session_batch needs at least one trajectory")
    rows = [_fields(t) for t in trajectories]
    width = max(len(ids) for ids, _, _, _ in rows)
    if width < 2:
        raise ValueError("a trajectory needs at least two tokens to score one")
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width - 1), dtype=torch.float32)
    sampler = torch.zeros((batch, width - 1), dtype=torch.float32)
    for b, (ids, loss_mask, logprobs, _) in enumerate(rows):
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        attention[b, :n] = 1
        if n > 1:
            mask[b, : n - 1] = torch.tensor(loss_mask[1:], dtype=torch.float32)
            sampler[b, : n - 1] = torch.tensor(logprobs[1:], dtype=torch.float32)
    return SessionBatch(input_ids, attention, mask, sampler, [p for _, _, _, p in rows])


def next_token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """log p(token t+1 | ≤ t) from a causal LM's logits [B, L, V]: [B, L-1], float32."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None])[..., 0]
