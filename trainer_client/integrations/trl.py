"""TRL's GRPOTrainer on a Tether fleet: generation through the router, weights out per step.

Two pieces, both on TRL's public extension points (no private method is replaced):

- `TetherRollout` is a `rollout_func` for `GRPOTrainer(rollout_func=...)`. It sends every
  completion the trainer asks for through `RolloutClient` under a version constraint
  (`max_lag` behind the latest published version, or `exact` = the trainer's own version),
  and returns the prompt ids, completion ids and per-token sampler log-probs TRL expects.
  It checks each answer's stamped versions against the constraint it was sent with and
  measures, on the trainer's model, the importance ratio p_trainer/q of every sampled token.
- `TetherGRPOTrainer(correction=<preset name>)` is `GRPOTrainer` with its public
  `compute_loss` answering with one of Tether's named correction presets
  (`correction_presets`), weighted by the sampler log-probs the rollout returned; without a
  preset it is TRL's own loss, unchanged.
- `TetherPublishCallback` is a `TrainerCallback`: after every optimizer step it publishes the
  trained weights through `Publisher` (the store encodes deltas between anchors), and adds
  Tether's figures (version, staleness, 409 retries, violations, ratios) to TRL's logs.

This module never starts processes, never chooses hyper-parameters for the trainer and
replaces no private TRL method; only `TetherGRPOTrainer` with a preset changes the loss.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from trainer_client.correction_presets import CorrectionPreset, correction_preset
from trainer_client.publisher import Publisher
from trainer_client.rollout_client import ConstraintViolated, RolloutClient, RolloutError
from trainer_client.rollout_result import RolloutResult
from trainer_client.staleness import group_staleness


@dataclass
class RolloutBatchStats:
    """What one call of the rollout function saw; the callback logs the latest."""

    rollouts: int = 0
    constraint_violations: int = 0
    retries_409: int = 0
    staleness_max: int = 0
    versions: list[int] = field(default_factory=list)
    ratio_mean: float = math.nan
    ratio_min: float = math.nan
    ratio_max: float = math.nan


class TetherRollout:
    """`rollout_func(prompts, trainer)` for TRL's GRPOTrainer over a Tether control plane.

    `max_lag`: each request accepts any version at least latest − `max_lag` (0: the newest
    only); `exact`: each request must be served by exactly the publisher's current version
    (needs `publisher`). `publisher` tells the trainer's version, for staleness. Extra
    `sampling_params` go to the engine beside TRL's `max_completion_length` and temperature.
    """

    def __init__(
        self,
        control_plane: str,
        token: str,
        run_id: str,
        *,
        publisher: Publisher | None = None,
        max_lag: int | None = 0,
        exact: bool = False,
        deadline_s: float = 120.0,
        concurrency: int = 16,
        sampling_params: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        if exact and publisher is None:
            raise ValueError("exact=True needs the publisher: pass publisher=... to TetherRollout")
        self.control_plane = control_plane
        self.token = token
        self.run_id = run_id
        self.publisher = publisher
        self.max_lag = max_lag
        self.exact = exact
        self.deadline_s = deadline_s
        self.concurrency = concurrency
        self.sampling_params = dict(sampling_params or {})
        self.seed = seed
        self.calls = 0
        self.last = RolloutBatchStats()
        self.history: list[RolloutBatchStats] = []

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        prompt_ids = [self._encode(tokenizer, p) for p in prompts]
        params = {
            "max_new_tokens": int(trainer.max_completion_length),
            "temperature": float(trainer.temperature),
            **self.sampling_params,
        }
        self.calls += 1
        results = asyncio.run(self._sample(prompt_ids, params))
        stats = RolloutBatchStats(rollouts=len(results))
        trainer_version = self.publisher.version if self.publisher is not None else None
        for result in results:
            stats.constraint_violations += not result.satisfies_constraint
            stats.retries_409 += result.not_ready_retries
            stats.versions.extend(result.versions)
            if trainer_version is not None:
                stats.staleness_max = max(
                    stats.staleness_max, group_staleness(trainer_version, result.versions)
                )
        completion_ids = [list(r.output_ids) for r in results]
        logprobs = [list(r.logprobs) for r in results]
        ratios = self._trainer_ratios(trainer, prompt_ids, completion_ids, logprobs)
        if ratios.numel():
            stats.ratio_mean = float(ratios.mean())
            stats.ratio_min = float(ratios.min())
            stats.ratio_max = float(ratios.max())
        self.last = stats
        self.history.append(stats)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "tether_version": [r.oldest_version for r in results],
        }

    @staticmethod
    def _encode(tokenizer: Any, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        # Conversational prompts are templated here, at the backend boundary, as TRL asks.
        return list(
            tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        )

    async def _sample(
        self, prompt_ids: list[list[int]], params: dict[str, Any]
    ) -> list[RolloutResult]:
        limit = asyncio.Semaphore(self.concurrency)
        async with RolloutClient(
            self.control_plane, self.token, run_id=self.run_id, deadline_s=self.deadline_s
        ) as client:

            async def one(ids: list[int], index: int) -> RolloutResult:
                seed = (self.seed * 1_000_003 + self.calls * 10_007 + index) % 2**31
                exact = self.publisher.version if self.exact and self.publisher else None
                async with limit:
                    return await client.generate(
                        ids,
                        {**params, "sampling_seed": seed},
                        exact_version=exact,
                        max_lag=None if self.exact else self.max_lag,
                    )

            try:
                return list(
                    await asyncio.gather(*(one(ids, i) for i, ids in enumerate(prompt_ids)))
                )
            except ConstraintViolated:
                raise
            except RolloutError as error:
                raise RuntimeError(f"Tether rollout failed: {error}") from error

    @staticmethod
    def _trainer_ratios(
        trainer: Any,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        sampler_logprobs: list[list[float]],
    ) -> torch.Tensor:
        """p_trainer/q of every sampled token, on the trainer's current weights, detached."""
        model = trainer.model
        device = next(model.parameters()).device
        ratios: list[torch.Tensor] = []
        with torch.no_grad():
            for prompt, completion, q in zip(
                prompt_ids, completion_ids, sampler_logprobs, strict=True
            ):
                if not completion:
                    continue
                ids = torch.tensor([prompt + completion], device=device)
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                logp = torch.log_softmax(logits / float(trainer.temperature), dim=-1)
                taken = logp.gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0]
                delta = (taken - torch.tensor(q, device=device)).clamp(-20.0, 20.0)
                ratios.append(delta.exp().cpu())
        return torch.cat(ratios) if ratios else torch.empty(0)


class TetherPublishCallback(TrainerCallback):
    """Publishes the model after every optimizer step and logs Tether's figures in TRL's logs.

    `names`: the tensors to publish (default: those of the boot version the publisher
    claimed, so tied weights appear once). `steps` keeps one record per published step.
    """

    def __init__(
        self,
        publisher: Publisher,
        rollout: TetherRollout | None = None,
        names: set[str] | None = None,
    ) -> None:
        self.publisher = publisher
        self.rollout = rollout
        base = publisher.encoder.base
        self.names = names if names is not None else (set(base) if base is not None else None)
        self.steps: list[dict[str, Any]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> Any:
        weights = {
            k: v.detach().cpu()
            for k, v in model.state_dict().items()
            if self.names is None or k in self.names
        }
        report = self.publisher.publish(weights)
        record: dict[str, Any] = {
            "step": int(state.global_step),
            "version": report.version,
            "kind": report.kind.value,
            "bytes": report.bytes,
        }
        if self.rollout is not None:
            stats = asdict(self.rollout.last)
            stats.pop("versions")
            record.update(stats)
        self.steps.append(record)
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> Any:
        if logs is not None and self.steps:
            last = self.steps[-1]
            for key in ("version", "staleness_max", "retries_409", "constraint_violations"):
                if key in last:
                    logs[f"tether/{key}"] = last[key]
            for key in ("ratio_mean", "ratio_min", "ratio_max"):
                if key in last:
                    logs[f"tether/is_{key}"] = last[key]
        return control


class TetherGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose loss is a named Tether correction preset, selected by one string.

    `correction`: `"token-tis"`, `"sequence-mis"` or `"geometric-mask"` (see
    `trainer_client.correction_presets`); None keeps TRL's loss. The preset weights each
    token by p_old/q with q the sampler log-probs `TetherRollout` returned (TRL keeps them as
    `sampling_per_token_logps`) and p_old TRL's old log-probs when it computed them, else the
    current ones (one update per batch). The preset's metrics join TRL's logs as
    `tether/loss_<metric>`. The score-centring preset needs the sampler's top-k head,
    which TRL 1.16 does not carry from a `rollout_func` to the loss, so it is refused.
    """

    def __init__(self, *args: Any, correction: str | None = None, **kwargs: Any) -> None:
        self.tether_preset: CorrectionPreset | None = None
        if correction is not None:
            preset = correction_preset(correction)
            if preset.loss != "policy":
                raise ValueError(
                    f"correction {correction!r} needs the sampler's top-k head, which TRL's "
                    "rollout_func cannot pass to the loss; choose token-tis, sequence-mis or "
                    "geometric-mask"
                )
            self.tether_preset = preset
        self.tether_loss_metrics: dict[str, float] = {}
        super().__init__(*args, **kwargs)
        if self.tether_preset is not None and self.beta != 0:
            raise ValueError(
                f"correction {correction!r} has no KL-to-reference term: set GRPOConfig(beta=0.0) "
                f"(got beta={self.beta})"
            )

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if self.tether_preset is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError("GRPOTrainer does not return outputs from compute_loss")
        sampler = inputs.get("sampling_per_token_logps")
        if sampler is None:
            raise ValueError(
                "a Tether correction needs the sampler log-probs: train with "
                "rollout_func=TetherRollout(...)"
            )
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        mask = inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([inputs["prompt_mask"], mask], dim=1)
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        # Position t predicts token t + 1: the completion's log-probs come from the logits
        # one to the left, divided by the sampling temperature once, as the engine did.
        logits = logits[:, prompt_ids.shape[1] - 1 : -1].float() / float(self.temperature)
        logprobs = torch.log_softmax(logits, dim=-1)
        logprobs = logprobs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        old = inputs.get("old_per_token_logps")
        out = self.tether_preset.policy_loss(
            logprobs,
            torch.nan_to_num(sampler.to(logprobs.dtype), nan=0.0),
            inputs["advantages"],
            mask,
            old_logprobs=old.to(logprobs.dtype) if old is not None else None,
        )
        self.tether_loss_metrics = dict(out.metrics)
        return out.loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training step's log, not the end-of-training summary
            for key, value in self.tether_loss_metrics.items():
                logs[f"tether/loss_{key}"] = value
        super().log(logs, start_time)
