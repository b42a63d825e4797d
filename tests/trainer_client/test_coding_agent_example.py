"""The coding-agent example runs episodes through sessions and trains on them (issue 20).

The example script is the test's subject: a control plane and a reference engine with its
agent serve the tiny model; each episode is a multi-turn session whose final patch the
sandbox scores against the built-in `calc` task; the trajectories become samples that one
batch of the MIS-corrected policy loss consumes. Its last line is the JSON summary these
assertions read, and the samples file it names is read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EPISODES = 2
TURNS = 3  # the scripted agent's task, file read and test run


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("coding-agent")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "coding_agent.py"), "--episodes",
         str(EPISODES), "--engines", "1", "--max-tokens", "8", "--workdir", str(workdir)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(700)
def test_the_fix_earns_reward_one_and_the_wrong_fix_zero(summary):
    assert summary["episodes"] == EPISODES
    assert summary["rewards"] == [1, 0]


@pytest.mark.timeout(700)
def test_samples_carry_the_whole_episode_with_a_mask_on_sampled_tokens_only(summary):
    samples = [json.loads(line) for line in Path(summary["samples"]).read_text().splitlines()]
    assert len(samples) == EPISODES
    for sample in samples:
        assert sample["turns"] == TURNS
        n = len(sample["token_ids"])
        assert len(sample["loss_mask"]) == len(sample["logprobs"]) == len(sample["versions"]) == n
        sampled = [i for i, m in enumerate(sample["loss_mask"]) if m]
        assert 0 < len(sampled) <= TURNS * 8  # at most max_tokens per model turn
        assert all(sample["logprobs"][i] <= 0.0 for i in sampled)
        assert all(sample["versions"][i] == 0 for i in sampled)  # pinned to the boot version
        assert all(sample["logprobs"][i] == 0.0 for i in range(n) if not sample["loss_mask"][i])


@pytest.mark.timeout(700)
def test_the_trainer_scores_exactly_the_tokens_the_engine_sampled(summary):
    # Token in, token out: the trainer's logprobs of the recorded ids on the same weights
    # match the sampler's. A single shifted or re-tokenized id would be off by nats.
    assert summary["trainable_tokens"] > 0
    assert summary["max_logprob_gap"] < 0.05
    assert abs(summary["is_weight_mean"] - 1.0) < 0.05
    assert summary["loss"] == summary["loss"]  # finite, not NaN
