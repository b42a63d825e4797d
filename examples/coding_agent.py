"""A coding agent's rollouts through Tether sessions, end to end:
`python examples/coding_agent.py --episodes N`.

Starts a local fleet (a control plane and reference engines serving the tiny offline model,
as `tether demo` does) and builds the sandbox's example task (a `calc` repository whose
`add` subtracts; `sandboxes/example.py`). Each episode then

1. opens a session pinned to the boot version (`POST /v1/sessions`);
2. runs a small scripted agent loop with the OpenAI SDK at `base_url =
   <cp>/v1/sessions/{id}`: the task, then the results of the tool calls the script decides
   (read the file, run the tests), each after one model turn. The tiny model's words are
   no code: the script also chooses the final patch (the fix on even episodes, a wrong fix
   on odd ones), while every model turn is sampled and recorded by the session;
3. fetches the trajectory (the exact token ids the engine consumed and sampled, the loss
   mask, the sampler's logprobs and the weight versions) and ends the session;
4. applies the final patch to the task and scores it with the sandbox scorer (isolated test
   run; reward 1 when the task's failing test passes and nothing else broke).

It writes one trainer-ready sample per episode to `<workdir>/samples.jsonl` (token ids,
loss mask, sampler logprobs, versions, reward) and feeds them as one batch
(`trainer_client.session_batch`) to `trainer_client.losses.policy_loss` (GRPO advantages,
MIS correction) with the trainer's own logprobs from transformers on the same weights. The
last line printed is ONE JSON object: episodes, turns, rewards, tokens, trainable_tokens,
loss, the largest trainer/sampler logprob gap on trainable tokens, the MIS weight mean.

What is specific to Tether is marked "Tether:"; the rest is an ordinary agent loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from demo.local_fleet import prepare_models, start_controlplane, start_engines
from demo.run import wait_converged
from demo.settings import DemoSettings
from launcher.processes import ProcessGroup
from sandboxes.example import ExampleTask, make_example_task
from sandboxes.local import LocalSandbox
from sandboxes.scoring import score
from trainer_client.publisher import Publisher

SYSTEM = "You are a coding agent. Read the code, run the tests, then answer with a patch."
FAILING_TESTS = "tests/test_ops.py::test_add FAILED: assert add(2, 3) == 5 (got -1)"


@dataclass
class Sample:
    """One episode, ready for a trainer: the whole token sequence and what goes with it."""

    episode: int
    session_id: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 exactly on model-sampled tokens
    logprobs: list[float]  # the sampler's logprob of each token (0.0 where the mask is 0)
    versions: list[int | None]  # the weight version that sampled each token
    reward: int
    status: str
    turns: int


def agent_turns(task: ExampleTask) -> list[str]:
    """What the scripted agent says after each model turn: the task, then its tool results."""
    ops = (task.repo / "calc" / "ops.py").read_text()
    return [
        f"Task {task.task().id}: add(a, b) must return the sum. Fix calc/ops.py.",
        f"Tool result (read_file calc/ops.py):\n{ops}",
        f"Tool result (run_tests):\n{FAILING_TESTS}",
    ]


def run_episode(
    client: httpx.Client, run_id: str, task: ExampleTask, episode: int, max_tokens: int
) -> tuple[dict[str, Any], str]:
    """One session: the scripted loop, then its trajectory. Returns (trajectory, patch)."""
    from openai import OpenAI

    # Tether: one session per episode, pinned to v0 so the whole episode is on one version.
    created = client.post(
        "/v1/sessions",
        json={"run_id": run_id, "version": {"exact": 0}, "labels": {"episode": str(episode)}},
    )
    created.raise_for_status()
    session = created.json()["session_id"]
    base = f"/v1/sessions/{session}"
    # Tether: the session is the OpenAI base_url; the token is the API key.
    llm = OpenAI(
        base_url=f"{client.base_url}{base}",
        api_key=client.headers["Authorization"].removeprefix("Bearer "),
        max_retries=0,
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    try:
        for said in agent_turns(task):
            messages.append({"role": "user", "content": said})
            answer = llm.chat.completions.create(
                model=run_id,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=1.0,
                seed=episode,
            )
            # Sent back as answered: the session holds the history against its record.
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        record = client.get(f"{base}/trajectory")  # Tether: the exact ids, mask, logprobs
        record.raise_for_status()
    finally:
        client.delete(base)
    # The model cannot write the fix: the script chooses, so the group holds both rewards.
    patch = task.gold_patch if episode % 2 == 0 else task.wrong_patch
    return record.json(), patch


def reward_of(task: ExampleTask, patch: str, unisolated: bool) -> tuple[int, str]:
    """Apply `patch` to the task's repository and run its tests in a sandbox."""
    result = score(
        task.task(),
        patch,
        sandbox_factory=lambda spec: LocalSandbox(spec, allow_unisolated=unisolated),
    )
    if result.reward is None:
        raise RuntimeError(f"the sandbox failed, no reward: {result.reason}")
    return result.reward, result.status.value


def train_on(samples: list[Sample], model_dir: Path) -> dict[str, float]:
    """One batch through the loss: GRPO advantages over the episodes, MIS-corrected policy
    loss with the trainer's logprobs of exactly the sampled tokens, and a backward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_client.losses import grpo_advantages, policy_loss
    from trainer_client.session_batch import next_token_logprobs, session_batch

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = session_batch([asdict(s) for s in samples])
    logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = next_token_logprobs(logits, batch.input_ids)
    rewards = torch.tensor([float(s.reward) for s in samples])
    advantages = grpo_advantages(rewards, group_size=len(samples))
    out = policy_loss(logprobs, batch.sampler_logprobs, advantages, batch.mask, correction="mis")
    out.loss.backward()
    trainable = batch.mask.bool()
    gap = (logprobs.detach() - batch.sampler_logprobs).abs()[trainable]
    return {
        "loss": float(out.loss.detach()),
        "max_logprob_gap": float(gap.max()) if gap.numel() else 0.0,
        "is_weight_mean": out.metrics["is_weight_mean"],
        "trainable_tokens": int(trainable.sum()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per model turn")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--unisolated", action="store_true", help="score unisolated if bubblewrap is unusable"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.episodes < 2 or args.episodes % 2:
        parser.error("--episodes: an even number, at least 2 (half fix the bug, half do not)")
    started = time.perf_counter()
    logging.basicConfig(level=logging.WARNING)
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="tether-agent-"))).resolve()
    run_id = "coding-agent"
    store_url = str(workdir / "store")
    layout = tuple(("bf16", "reference") for _ in range(args.engines))
    settings = DemoSettings(engines=args.engines, layout=layout, seed=args.seed, workdir=workdir)
    task = make_example_task(workdir / "tasks")

    samples: list[Sample] = []
    with ProcessGroup(workdir / "logs") as group:
        # Tether: a local fleet (a real deployment already has one).
        models = prepare_models(workdir / "models", {"bf16"}, args.seed)
        cp = start_controlplane(group, f"sqlite:///{workdir / 'cp.db'}", store_url)
        publisher = Publisher(store_url, run_id, cp.url, cp.tokens["trainer"], progress=False)
        publisher.claim(0, models["bf16"])
        publisher.close()
        start_engines(group, settings, models, cp, run_id, store_url, workdir / "run")
        wait_converged(cp, run_id, 0, args.engines)
        headers = {"Authorization": f"Bearer {cp.tokens['client']}"}
        with httpx.Client(base_url=cp.url, headers=headers, timeout=120.0) as client:
            for episode in range(args.episodes):
                trajectory, patch = run_episode(client, run_id, task, episode, args.max_tokens)
                reward, status = reward_of(task, patch, args.unisolated)
                samples.append(
                    Sample(
                        episode=episode,
                        session_id=trajectory["session_id"],
                        token_ids=trajectory["token_ids"],
                        loss_mask=trajectory["loss_mask"],
                        logprobs=trajectory["logprobs"],
                        versions=trajectory["token_versions"],
                        reward=reward,
                        status=status,
                        turns=len(trajectory["turns"]),
                    )
                )
                print(
                    f"episode {episode}: {samples[-1].turns} turns, "
                    f"{len(samples[-1].token_ids)} tokens, reward {reward} ({status})",
                    flush=True,
                )

    out = workdir / "samples.jsonl"
    out.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))
    figures = train_on(samples, models["bf16"])
    summary = {
        "episodes": len(samples),
        "turns": sum(s.turns for s in samples),
        "rewards": [s.reward for s in samples],
        "tokens": sum(len(s.token_ids) for s in samples),
        **figures,
        "samples": str(out),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
