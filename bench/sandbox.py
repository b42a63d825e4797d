"""Sandbox benchmark: tasks scored per minute with the local backend, and isolation overhead.

Throughput: `tasks` example tasks (half with the correct patch, half with a wrong one),
scored by `workers` threads in parallel. Overhead: the same pytest suite run bare on the host
and inside a `LocalSandbox` (bwrap, uid drop, rlimits), `repeats` times each, alternating;
the ratio of medians is reported, for wall time and for the CPU time of the whole process
tree (bwrap, setpriv, prlimit and pytest; from the children's rusage), with the machine's
load average. Run: `python -m bench.sandbox` or `tether bench sandbox`.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def _suite_command(python: str) -> list[str]:
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ops.py"]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Runs:
    """Wall and CPU seconds of repeated runs of one command line."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def measure(self, run: Callable[[], T]) -> T:
        cpu, start = _children_cpu_s(), time.perf_counter()
        result = run()
        self.wall.append(time.perf_counter() - start)
        self.cpu.append(_children_cpu_s() - cpu)
        return result

    def medians(self) -> tuple[float, float]:
        return statistics.median(self.wall), statistics.median(self.cpu)


def _overhead(root: Path, repeats: int) -> tuple[_Runs, _Runs]:
    """Wall and CPU seconds of the example suite run bare and sandboxed (gold applied)."""
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
    bare, boxed = _Runs(), _Runs()
    with LocalSandbox() as sandbox:
        sandbox.upload_tree(example.repo)
        for _ in range(repeats):
            done = bare.measure(
                lambda: subprocess.run(
                    _suite_command(python),
                    cwd=example.repo,
                    env={**env, "HOME": os.getcwd()},
                    capture_output=True,
                )
            )
            if done.returncode != 0:
                raise RuntimeError(f"bare suite failed: {done.stdout[-500:]!r}")
            result = boxed.measure(
                lambda: sandbox.exec(_suite_command(python), env=env, timeout_s=120)
            )
            if not result.ok:
                raise RuntimeError(f"sandboxed suite failed: {result.describe()}")
    return bare, boxed


def run(tasks: int = 8, workers: int = 2, repeats: int = 9) -> dict[str, float]:
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
        bare_runs, boxed_runs = _overhead(root, repeats)
    (bare, bare_cpu), (boxed, boxed_cpu) = bare_runs.medians(), boxed_runs.medians()
    figures = {
        "tasks": tasks,
        "workers": workers,
        "tasks_per_minute": round(tasks / elapsed * 60, 1),
        "seconds_per_task": round(elapsed / tasks, 3),
        "unexpected_rewards": wrong_rewards,
        "bare_pytest_s": round(bare, 3),
        "sandboxed_pytest_s": round(boxed, 3),
        "isolation_overhead_ratio": round(boxed / bare, 2),
        "bare_pytest_cpu_s": round(bare_cpu, 3),
        "sandboxed_pytest_cpu_s": round(boxed_cpu, 3),
        "isolation_cpu_ratio": round(boxed_cpu / bare_cpu, 2) if bare_cpu else 0.0,
        "load_average_1min": round(os.getloadavg()[0], 1),
    }
    table = Table(title="sandbox: local backend")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("tasks scored per minute", f"{figures['tasks_per_minute']}")
    table.add_row("seconds per task (wall / tasks)", f"{figures['seconds_per_task']}")
    table.add_row("bare pytest (median s)", f"{bare:.3f}")
    table.add_row("sandboxed pytest (median s)", f"{boxed:.3f}")
    table.add_row("sandboxed / bare (wall)", f"{figures['isolation_overhead_ratio']}x")
    table.add_row("bare pytest CPU (median s)", f"{bare_cpu:.3f}")
    table.add_row("sandboxed pytest CPU (median s)", f"{boxed_cpu:.3f}")
    table.add_row("sandboxed / bare (CPU)", f"{figures['isolation_cpu_ratio']}x")
    table.add_row("load average (1 min)", f"{figures['load_average_1min']}")
    console.print(table)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    import typer

    typer.run(run)
