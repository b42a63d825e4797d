"""TRL's GRPOTrainer on a local Tether fleet: `python examples/trl_grpo.py --steps N`.

Starts a control plane and reference engines serving the tiny offline model (as `tether
demo` does), claims the boot version, then trains with TRL's own GRPOTrainer on the demo's
addition task. Generation goes through the router (`TetherRollout`); every optimizer step
publishes a new version (`TetherPublishCallback`). Prints TRL's logs, one Tether line per
step, and finally ONE JSON line: steps, versions_published, rollouts,
constraint_violations, staleness_max, reward_first, reward_last, seconds (plus the fleet's
convergence and the importance-ratio range, which the test reads).

What is specific to Tether is marked "Tether:"; the rest is an ordinary GRPOTrainer script.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from demo.local_fleet import prepare_models, start_controlplane, start_engines
from demo.run import wait_converged
from demo.settings import DemoSettings
from demo.task import Problem, reward, sample_problems
from launcher.processes import ProcessGroup
from store.anchor import AnchorPolicy
from trainer_client.integrations.trl import (
    TetherGRPOTrainer,
    TetherPublishCallback,
    TetherRollout,
)
from trainer_client.publisher import Publisher


def addition_reward(
    completions: list[str], a: list[int], b: list[int], **_: Any
) -> list[float | None]:
    """The demo's shaped reward for each completion of `a+b=`."""
    return [reward(Problem(x, y), text) for text, x, y in zip(completions, a, b, strict=True)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-lag", type=int, default=0)
    parser.add_argument(
        "--exact", action="store_true", help="pin every rollout to the trainer's version"
    )
    parser.add_argument("--learning-rate", type=float, default=5e-2)
    parser.add_argument(
        "--correction",
        default=None,
        help="a Tether correction preset (token-tis, sequence-mis, geometric-mask); "
        "default: TRL's own loss",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    logging.basicConfig(level=logging.WARNING)
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="tether-trl-"))).resolve()
    run_id = "trl-grpo"
    store_url = str(workdir / "store")
    layout = tuple(("bf16", "reference") for _ in range(args.engines))
    settings = DemoSettings(engines=args.engines, layout=layout, seed=args.seed, workdir=workdir)

    with ProcessGroup(workdir / "logs") as group:
        # Tether: a local fleet (a real deployment already has one; skip to the Publisher).
        models = prepare_models(workdir / "models", {"bf16"}, args.seed)
        cp = start_controlplane(group, f"sqlite:///{workdir / 'cp.db'}", store_url)
        publisher = Publisher(
            store_url, run_id, cp.url, cp.tokens["trainer"],
            anchor_policy=AnchorPolicy(every=10), progress=False,
        )  # fmt: skip
        publisher.claim(0, models["bf16"])
        start_engines(group, settings, models, cp, run_id, store_url, workdir / "run")

        tokenizer = AutoTokenizer.from_pretrained(models["bf16"])
        model = AutoModelForCausalLM.from_pretrained(models["bf16"])
        for name, parameter in model.named_parameters():
            parameter.requires_grad = name.startswith("lm_head")  # as the demo trains
        problems = sample_problems(random.Random(args.seed), args.steps * args.prompts_per_step)
        dataset = Dataset.from_list([{"prompt": p.prompt, "a": p.a, "b": p.b} for p in problems])

        # Tether: generation through the router, and a new version after every step.
        rollout = TetherRollout(
            cp.url, cp.tokens["trainer"], run_id, publisher=publisher,
            max_lag=args.max_lag, exact=args.exact, seed=args.seed,
        )  # fmt: skip
        callback = TetherPublishCallback(publisher, rollout)

        config = GRPOConfig(
            output_dir=str(workdir / "trl"),
            max_steps=args.steps,
            per_device_train_batch_size=args.prompts_per_step * args.group_size,
            num_generations=args.group_size,
            max_completion_length=1,
            temperature=1.0,
            learning_rate=args.learning_rate,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            seed=args.seed,
            shuffle_dataset=False,
        )
        trainer = TetherGRPOTrainer(  # Tether: GRPOTrainer, or this for a correction preset
            model=model,
            reward_funcs=addition_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout,  # Tether
            callbacks=[callback],  # Tether
            correction=args.correction,  # Tether
        )
        try:
            trainer.train()
        finally:
            publisher.close()
        for record in callback.steps:
            print(
                f"tether step {record['step']}: v{record['version']} ({record['kind']}, "
                f"{record['bytes']} B) rollouts {record.get('rollouts', 0)} "
                f"staleness_max {record.get('staleness_max', 0)} "
                f"409s {record.get('retries_409', 0)} "
                f"violations {record.get('constraint_violations', 0)} "
                f"ratio [{record.get('ratio_min', float('nan')):.4f}, "
                f"{record.get('ratio_max', float('nan')):.4f}]",
                flush=True,
            )
        converged = wait_converged(cp, run_id, publisher.version or 0, args.engines)

    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    summary = {
        "steps": int(trainer.state.global_step),
        "versions_published": len(callback.steps),
        "last_version": publisher.version,
        "rollouts": sum(s.rollouts for s in rollout.history),
        "constraint_violations": sum(s.constraint_violations for s in rollout.history),
        "retries_409": sum(s.retries_409 for s in rollout.history),
        "staleness_max": max((s.staleness_max for s in rollout.history), default=0),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "ratio_min": min(s.ratio_min for s in rollout.history) if rollout.history else None,
        "ratio_max": max(s.ratio_max for s in rollout.history) if rollout.history else None,
        "correction": args.correction,
        "is_weight_mean": [
            e["tether/loss_is_weight_mean"]
            for e in trainer.state.log_history
            if "tether/loss_is_weight_mean" in e
        ],
        "engines_converged": converged["engines_converged"],
        "final_versions": converged["final_versions"],
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
