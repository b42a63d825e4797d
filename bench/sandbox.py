"""Sandbox benchmark: tasks scored per minute with the local backend, and isolation overhead.

Throughput: `tasks` example tasks (half with the correct patch, half with a wrong one),
scored by `workers` threads in parallel. Overhead: the same pytest suite run bare on the host
and inside a `LocalSandbox` (bwrap, uid drop, rlimits), `repeats` times each; the ratio of
medians is reported. Run: `python -m bench.sandbox` or `tether bench sandbox`.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _suite_command(python: str) -> list[str]:
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ops.py"]


def _overhead(root: Path, repeats: int) -> tuple[float, float]:
    """Median seconds of the example suite run bare and sandboxed (gold patch applied)."""
    import os
    import subprocess

    from sandboxes.example import make_example_task
    from sandboxes.local import LocalSandbox, base_env

    example = make_example_task(root, name="overhead")
    subprocess.run(
        ["git", "apply"], input=example.gold_patch.encode(), cwd=example.repo, check=True
    )
    task = example.task()
    subprocess.run(["git", "apply"], input=task.test_patch.encode(), cwd=example.repo, check=True)
    python = sys.executable
    env = {**base_env(python), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    bare, boxed = [], []
    with LocalSandbox() as sandbox:
        sandbox.upload_tree(example.repo)
        for _ in range(repeats):
            start = time.perf_counter()
            done = subprocess.run(
                _suite_command(python),
                cwd=example.repo,
                env={**env, "HOME": os.getcwd()},
                capture_output=True,
            )
            bare.append(time.perf_counter() - start)
            if done.returncode != 0:
                raise RuntimeError(f"bare suite failed: {done.stdout[-500:]!r}")
            start = time.perf_counter()
            result = sandbox.exec(_suite_command(python), env=env, timeout_s=120)
            boxed.append(time.perf_counter() - start)
            if not result.ok:
                raise RuntimeError(f"sandboxed suite failed: {result.describe()}")
    return statistics.median(bare), statistics.median(boxed)


def run(tasks: int = 8, workers: int = 2, repeats: int = 5) -> dict[str, float]:
    """Score TASKS example tasks with WORKERS in parallel; time REPEATS bare/sandboxed runs."""
    from concurrent.futures import ThreadPoolExecutor

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from sandboxes.example import make_example_task
    from sandboxes.scoring import score

    console = Console()
    with tempfile.TemporaryDirectory(prefix="tether-bench-sandbox-") as scratch:
        root = Path(scratch)
        examples = [make_example_task(root, name=f"task{i}") for i in range(tasks)]
        jobs = [
            (ex.task(), ex.gold_patch if i % 2 == 0 else ex.wrong_patch, 1 if i % 2 == 0 else 0)
            for i, ex in enumerate(examples)
        ]
        wrong_rewards = 0
        with Progress(console=console) as progress, ThreadPoolExecutor(workers) as pool:
            bar = progress.add_task("scoring", total=len(jobs))
            start = time.perf_counter()
            futures = [pool.submit(score, task, patch) for task, patch, _ in jobs]
            for future, (_, _, expected) in zip(futures, jobs, strict=True):
                wrong_rewards += future.result().reward != expected
                progress.advance(bar)
            elapsed = time.perf_counter() - start
        bare, boxed = _overhead(root, repeats)
    figures = {
        "tasks": tasks,
        "workers": workers,
        "tasks_per_minute": round(tasks / elapsed * 60, 1),
        "seconds_per_task": round(elapsed / tasks, 3),
        "unexpected_rewards": wrong_rewards,
        "bare_pytest_s": round(bare, 3),
        "sandboxed_pytest_s": round(boxed, 3),
        "isolation_overhead_ratio": round(boxed / bare, 2),
    }
    table = Table(title="sandbox: local backend")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("tasks scored per minute", f"{figures['tasks_per_minute']}")
    table.add_row("seconds per task (wall / tasks)", f"{figures['seconds_per_task']}")
    table.add_row("bare pytest (median s)", f"{bare:.3f}")
    table.add_row("sandboxed pytest (median s)", f"{boxed:.3f}")
    table.add_row("sandboxed / bare", f"{figures['isolation_overhead_ratio']}x")
    console.print(table)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    import typer

    typer.run(run)
