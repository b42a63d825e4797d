"""Sandbox benchmark: tasks scored per minute with the local backend, and isolation overhead.

Throughput: `tasks` example tasks (half with the correct patch, half with a wrong one),
scored by `workers` threads in parallel. Overhead: the same pytest suite run bare on the host
and inside a `LocalSandbox` (bwrap, uid drop, rlimits), `repeats` times each, alternating;
the ratio of medians is reported, for wall time and for the CPU time pytest's process
reports for itself (isolation should cost wall time, bwrap/setpriv/prlimit start-up, not
pytest's own CPU), with the machine's load average.
Run: `python -m bench.sandbox` or `tether bench sandbox`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


# pytest, as `python -m pytest` runs it, printing its process's CPU seconds (interpreter
# start included) last: the same figure bare and sandboxed, whatever tree runs it.
_SUITE = (
    "import sys, time, pytest\n"
    "code = pytest.main(sys.argv[1:])\n"
    "print(f'\\ntether-cpu-s {time.process_time():.6f}')\n"
    "sys.exit(code)\n"
)


def _suite_command(python: str) -> list[str]:
    return [python, "-c", _SUITE, "-q", "-p", "no:cacheprovider", "tests/test_ops.py"]


def _cpu_s(stdout: bytes) -> float:
    return float(stdout.rsplit(b"tether-cpu-s ", 1)[1].split()[0])


class _Runs:
    """Wall seconds of repeated runs of the suite, and the CPU seconds its process reports."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def measure(self, run: Callable[[], T], stdout: Callable[[T], bytes]) -> T:
        start = time.perf_counter()
        result = run()
        self.wall.append(time.perf_counter() - start)
        self.cpu.append(_cpu_s(stdout(result)))
        return result

    def medians(self) -> tuple[float, float]:
        return statistics.median(self.wall), statistics.median(self.cpu)


def _start_s(repeats: int) -> float:
    """Median wall seconds a sandboxed `true` takes beyond a bare one: the fixed cost of
    isolating one command (bwrap's namespaces and mounts, setpriv, prlimit, supervision)."""
    import subprocess

    from sandboxes.local import LocalSandbox

    extra = []
    with LocalSandbox() as sandbox:
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(["true"], check=True)
            bare = time.perf_counter() - start
            start = time.perf_counter()
            if not sandbox.exec(["true"], timeout_s=60).ok:
                raise RuntimeError("a sandboxed `true` failed")
            extra.append(time.perf_counter() - start - bare)
    return statistics.median(extra)


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
                ),
                lambda done: done.stdout,
            )
            if done.returncode != 0:
                raise RuntimeError(f"bare suite failed: {done.stdout[-500:]!r}")
            result = boxed.measure(
                lambda: sandbox.exec(_suite_command(python), env=env, timeout_s=120),
                lambda result: result.stdout,
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
        start_s = _start_s(3 * repeats)
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
        "sandbox_start_s": round(start_s, 4),
        # What the wall ratio would be where wall time is CPU time (an idle machine): pytest's
        # own CPU seconds plus the fixed start-up cost, over pytest's own CPU seconds.
        "idle_overhead_estimate": round((bare_cpu + start_s) / bare_cpu, 2) if bare_cpu else 0.0,
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
    table.add_row("sandbox start-up per command (median s)", f"{start_s:.4f}")
    table.add_row(
        "idle-machine estimate (CPU + start-up) / CPU", f"{figures['idle_overhead_estimate']}x"
    )
    table.add_row("load average (1 min)", f"{figures['load_average_1min']}")
    console.print(table)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    import typer

    typer.run(run)
