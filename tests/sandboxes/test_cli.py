"""`tether sandbox` and `tether bench sandbox` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sandboxes.example import ExampleTask

TETHER = [sys.executable, "-m", "cli"]


def tether(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TETHER, *args], capture_output=True, text=True, timeout=300)


def test_score_prints_the_reward_and_exits_zero(example: ExampleTask, tmp_path: Path):
    patch = tmp_path / "gold.diff"
    patch.write_text(example.gold_patch)
    done = tether(
        "sandbox", "score", "--task", str(example.task_path), "--patch", str(patch), "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reward"] == 1


def test_score_rejects_a_bad_task_file_without_a_traceback(tmp_path: Path):
    task = tmp_path / "task.json"
    task.write_text('{"id": "x"}')
    done = tether("sandbox", "score", "--task", str(task), "--patch", "/dev/null")
    assert done.returncode == 2
    assert "invalid" in done.stderr and "Traceback" not in done.stderr


def test_score_exits_three_on_an_infrastructure_failure(example: ExampleTask, tmp_path: Path):
    patch = tmp_path / "gold.diff"
    patch.write_text(example.gold_patch)
    done = tether(
        "sandbox",
        "score",
        "--task",
        str(example.task_path),
        "--patch",
        str(patch),
        "--python",
        "/nonexistent/python",
    )
    assert done.returncode == 3
    assert "infrastructure failure" in done.stderr


def test_check_reports_the_isolation_level():
    done = tether("sandbox", "check")
    assert done.returncode == 0 and "bwrap" in done.stdout


def test_the_benchmark_runs_at_a_tiny_size_and_ends_with_its_json_line():
    done = tether("bench", "sandbox", "--tasks", "2", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["unexpected_rewards"] == 0
    assert figures["tasks_per_minute"] > 0 and figures["isolation_overhead_ratio"] > 0
    assert figures["bare_pytest_cpu_s"] > 0 and figures["sandboxed_pytest_cpu_s"] > 0
    assert figures["sandbox_start_s"] > 0 and figures["idle_overhead_estimate"] > 1


def test_score_shows_the_tail_of_the_test_output(example: ExampleTask, tmp_path: Path):
    patch = tmp_path / "wrong.diff"
    patch.write_text(example.wrong_patch)
    args = ["sandbox", "score", "--task", str(example.task_path), "--patch", str(patch)]
    shown = tether(*args)
    assert shown.returncode == 0, shown.stderr
    assert "tail of the test output" in shown.stdout and "test_add" in shown.stdout
    as_json = json.loads(tether(*args, "--json").stdout)
    assert "failed" in as_json["output_tail"] and as_json["reward"] == 0


def test_check_accepts_a_valid_task(example: ExampleTask, tmp_path: Path):
    gold = tmp_path / "gold.diff"
    gold.write_text(example.gold_patch)
    done = tether("sandbox", "check", "--task", str(example.task_path), "--gold", str(gold))
    assert done.returncode == 0, done.stderr
    assert "is valid" in done.stdout


def test_check_rejects_a_task_with_a_mistyped_test_id_and_a_gold_that_fails(
    example: ExampleTask, tmp_path: Path
):
    raw = json.loads(example.task_path.read_text())
    raw["fail_to_pass"] = ["tests/test_ops.py::test_add", "tests/test_ops.py::test_ad"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**raw, "repo": str(example.repo)}))
    gold = tmp_path / "wrong.diff"
    gold.write_text(example.wrong_patch)
    done = tether("sandbox", "check", "--task", str(broken), "--gold", str(gold))
    assert done.returncode == 1
    assert "gold patch scores fail" in done.stderr
    assert "not collected by pytest" in done.stderr and "test_ad" in done.stderr


def test_check_rejects_a_task_whose_fail_to_pass_test_already_passes(
    example: ExampleTask, tmp_path: Path
):
    raw = json.loads(example.task_path.read_text())
    raw["fail_to_pass"] = ["tests/test_ops.py::test_sub"]
    raw["pass_to_pass"] = []
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**raw, "repo": str(example.repo)}))
    gold = tmp_path / "gold.diff"
    gold.write_text(example.gold_patch)
    done = tether("sandbox", "check", "--task", str(broken), "--gold", str(gold))
    assert done.returncode == 1
    assert "rewards doing nothing" in done.stderr and "test_sub" in done.stderr
