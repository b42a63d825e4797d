"""The demo's learner: the tiny model in FP32 on CPU, one GRPO step per batch of rollouts.

Owns the model, its optimiser and the loss: the trainer's log-probabilities of the sampled
tokens (temperature applied once, full vocabulary), GRPO advantages (group mean, no std
normalisation), and the MIS-corrected policy loss from `trainer_client.losses`, plus the
sampler/trainer gap per precision class. By default only the output head learns: that keeps
each version a small delta and learns the task within a few dozen steps on CPU. It never
talks to the network: rollouts come in, a state dict goes out for the Publisher.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from trainer_client.gap_metrics import GapMetrics


@dataclass(frozen=True)
class Sample:
    """One rollout as the learner needs it."""

    prompt_ids: list[int]
    output_ids: list[int]
    sampler_logprobs: list[float]
    reward: float
    precision: str


@dataclass
class StepMetrics:
    loss: float
    k3_by_precision: dict[str, float] = field(default_factory=dict)
    gap_by_precision: dict[str, GapMetrics] = field(default_factory=dict)
    mis_masked_fraction: float = 0.0


class Learner:
    """GRPO with MIS on the tiny model; `state_dict()` gives the weights to publish."""

    def __init__(
        self,
        model_dir: Path,
        *,
        learning_rate: float,
        temperature: float,
        seed: int,
        trainable: Sequence[str] = ("lm_head",),
    ) -> None:
        import torch
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the demo draws its own output
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.temperature = temperature
        # Only the parameters named with a `trainable` prefix learn: a few percent of the
        # BF16 values change per step, as in real RL fine-tuning, so versions are deltas.
        trained = []
        for name, parameter in self.model.named_parameters():
            parameter.requires_grad_(any(name.startswith(p) for p in trainable))
            if parameter.requires_grad:
                trained.append(parameter)
        if not trained:
            raise ValueError(f"no parameter name starts with any of {trainable}")
        self.optimizer = torch.optim.Adam(trained, lr=learning_rate)
        # Publish exactly the tensors the checkpoint holds (tied weights appear once).
        names: set[str] = set()
        for shard in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                names.update(handle.keys())
        self.published_names = names

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if k in self.published_names}

    def _logprobs(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Trainer log-probs of each sampled token [B, T] and the mask of real positions."""
        import torch

        width = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
        longest = max(len(s.output_ids) for s in samples)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(samples), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, s in enumerate(samples):
            sequence = s.prompt_ids + s.output_ids
            ids[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
        logits = self.model(input_ids=ids, attention_mask=attention).logits.float()
        logprobs = torch.log_softmax(logits / self.temperature, dim=-1)
        mask = torch.zeros((len(samples), longest))
        rows = []
        for row, s in enumerate(samples):
            # The logits at position i predict token i + 1: output token j sits at
            # len(prompt) + j and is predicted at len(prompt) + j - 1.
            start = len(s.prompt_ids) - 1
            positions = torch.arange(start, start + len(s.output_ids))
            picked = logprobs[row, positions, torch.tensor(s.output_ids, dtype=torch.long)]
            rows.append(torch.nn.functional.pad(picked, (0, longest - len(s.output_ids))))
            mask[row, : len(s.output_ids)] = 1
        values = torch.stack(rows)
        return values, mask

    def step(self, samples: Sequence[Sample], group_size: int) -> StepMetrics:
        """One optimiser step on `samples` (consecutive groups of `group_size`)."""
        import torch

        from trainer_client.gap_metrics import gap_metrics
        from trainer_client.losses import grpo_advantages, policy_loss

        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        advantages = grpo_advantages(rewards, group_size)
        logprobs, mask = self._logprobs(samples)
        sampler = torch.zeros_like(logprobs)
        for row, s in enumerate(samples):
            sampler[row, : len(s.sampler_logprobs)] = torch.tensor(s.sampler_logprobs)
        result = policy_loss(logprobs, sampler, advantages, mask, correction="mis")
        self.optimizer.zero_grad()
        result.loss.backward()
        self.optimizer.step()

        by_precision: dict[str, list[int]] = defaultdict(list)
        for row, s in enumerate(samples):
            by_precision[s.precision].append(row)
        gaps = {}
        for precision, rows in sorted(by_precision.items()):
            index = torch.tensor(rows)
            gaps[precision] = gap_metrics(logprobs.detach()[index], sampler[index], mask[index])
        return StepMetrics(
            loss=float(result.loss.detach()),
            k3_by_precision={p: g.k3_kl for p, g in gaps.items()},
            gap_by_precision=gaps,
            mis_masked_fraction=result.metrics.get("mis_masked_fraction", 0.0),
        )
