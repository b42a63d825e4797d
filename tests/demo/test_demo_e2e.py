"""`tether demo`, shortened: the whole loop runs end to end and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from store.store import Store
from store.types import VersionKind, VersionRef

ROOT = Path(__file__).resolve().parents[2]
TETHER = str(Path(sys.executable).with_name("tether"))
DEMO_DEADLINE_S = 240


def processes_under(workdir: Path) -> list[psutil.Process]:
    """Processes whose command line names the demo's work dir (its children do)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(workdir) in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(workdir: Path, deadline_s: float = 20.0) -> list[psutil.Process]:
    end = time.monotonic() + deadline_s
    while (left := processes_under(workdir)) and time.monotonic() < end:
        time.sleep(0.1)  # polling interval, bounded by the deadline
    return left


@pytest.mark.slow
def test_short_demo_trains_publishes_and_keeps_every_rollout_within_its_constraint(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "demo"
    done = subprocess.run(
        [TETHER, "demo", "--steps", "3", "--prompts", "4", "--group-size", "2",
         "--workdir", str(workdir), "--run", "e2e"],
        cwd=ROOT, capture_output=True, text=True, timeout=DEMO_DEADLINE_S,
        env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["versions_published"] == 4
    assert (summary["rollouts"], summary["failed_rollouts"]) == (3 * 4 * 2, 0)
    assert summary["constraint_violations"] == 0
    assert summary["engines_converged"] is True
    assert sorted(summary["final_versions"].values()) == [3, 3, 3]
    assert {key.split("@")[0] for key in summary["final_versions"]} == {"bf16", "fp8", "nvfp4"}
    assert set(summary["k3_kl"]) <= {"bf16", "fp8", "nvfp4"}
    # max_lag (0), plus the batch sampled ahead, plus a publish within the 0.5 s latest cache
    assert summary["staleness_max"] <= 2
    assert "Tether demo: summary" in done.stdout
    assert "/dashboard#token=tth_" in done.stdout  # the address of the live dashboard
    assert summary["gap_reports"] == 3  # the trainer reported its gap every step

    store = Store(str(workdir / "store"))
    assert store.read_pointer("e2e") == VersionRef("e2e", 3)
    kinds = [store.read_manifest(VersionRef("e2e", v)).kind for v in range(4)]
    assert kinds[0] is VersionKind.FULL and kinds[1:].count(VersionKind.DELTA) >= 2
    assert wait_gone(workdir) == []
    # The control plane stopped only after the agents: each one deregistered on its way out.
    agent_logs = sorted((workdir / "runs" / "e2e" / "logs").glob("agent-*.log"))
    assert len(agent_logs) == 3
    assert [p.name for p in agent_logs if "could not deregister" in p.read_text()] == []


@pytest.mark.slow
def test_an_interrupted_demo_stops_every_process_it_started(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    # Unbuffered, so the first step's line arrives when it is printed, and more steps than
    # it can finish before the signal: a fast machine once ran all 200 steps while the
    # step lines still sat in the pipe's buffer, and exited 0 before SIGINT.
    demo = subprocess.Popen(
        [TETHER, "demo", "--steps", "100000", "--prompts", "2", "--group-size", "2",
         "--workdir", str(workdir), "--run", "interrupted"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
    )  # fmt: skip
    try:
        assert demo.stdout is not None
        end = time.monotonic() + DEMO_DEADLINE_S
        for line in demo.stdout:  # until the first training step is printed
            if line.split()[:2] == ["1", "v1"]:
                break
            assert time.monotonic() < end, "the demo never reached its first step"
        assert len(processes_under(workdir)) >= 7  # control plane, 3 engines, 3 agents
        demo.send_signal(signal.SIGINT)
        try:
            rest = demo.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            demo.send_signal(signal.SIGABRT)  # the fault handler prints every thread's stack
            pytest.fail("the demo still ran 60 s after SIGINT:\n" + demo.communicate()[0][-6000:])
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, rest[-2000:]
    assert "interrupted" in rest
    assert wait_gone(workdir) == []
