"""What the demo shows: one line per training step, a summary table, one JSON line.

Owns the figures' names and their layout. `StepRecord` is what one step measured;
`DemoTotals` accumulates them; `print_header`/`print_step` draw the live lines and
`print_summary` the closing table. The JSON summary (`DemoTotals.summary`) is the demo's
machine-readable result. Pure formatting and arithmetic: it never measures anything itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class StepRecord:
    """Everything one step measured."""

    step: int
    version: int
    kind: str
    reward: float
    rollouts: int
    failed: int
    served: dict[str, list[int]]  # precision -> versions stamped on this step's rollouts
    staleness_mean: float
    staleness_max: int
    retries_409: int
    retries: int
    publish_bytes: int
    publish_ratio: float
    pauses: int
    pause_s: float
    k3: dict[str, float]
    violations: int
    seconds: float = 0.0


@dataclass
class DemoTotals:
    """The whole run, step by step."""

    steps: list[StepRecord] = field(default_factory=list)
    boot_bytes: int = 0
    # The client's own counts: they include retries of rollouts that finally failed.
    client_retries_409: int = 0
    client_retries: int = 0
    gap_reports: int = 0

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)

    def reward_window(self, first: bool, size: int = 10) -> float:
        rewards = [s.reward for s in self.steps]
        window = rewards[:size] if first else rewards[-size:]
        return round(fmean(window), 4) if window else 0.0

    def summary(self, seconds: float, **extra: Any) -> dict[str, Any]:
        """The JSON object the demo prints last."""
        kinds = [s.kind for s in self.steps]
        k3: dict[str, list[float]] = defaultdict(list)
        for s in self.steps:
            for precision, value in s.k3.items():
                k3[precision].append(value)
        return {
            "steps": len(self.steps),
            "seconds": round(seconds, 1),
            "reward_first10": self.reward_window(first=True),
            "reward_last10": self.reward_window(first=False),
            "versions_published": len(self.steps) + 1,  # the boot version, then one per step
            "full_versions": 1 + kinds.count("full"),
            "delta_versions": kinds.count("delta"),
            "rollouts": sum(s.rollouts for s in self.steps),
            "failed_rollouts": sum(s.failed for s in self.steps),
            "constraint_violations": sum(s.violations for s in self.steps),
            "retries_409": self.client_retries_409,
            "retries": self.client_retries,
            "gap_reports": self.gap_reports,
            "staleness_max": max((s.staleness_max for s in self.steps), default=0),
            "publish_bytes": self.boot_bytes + sum(s.publish_bytes for s in self.steps),
            "delta_ratio_mean": round(
                fmean([s.publish_ratio for s in self.steps if s.kind == "delta"] or [0.0]), 5
            ),
            "engine_pauses": sum(s.pauses for s in self.steps),
            "k3_kl": {p: round(fmean(v), 6) for p, v in sorted(k3.items())},
            **extra,
        }


def _versions(values: list[int]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"v{low}" if low == high else f"v{low}-{high}"


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f}GB"


def print_header(console: Console, precisions: list[str]) -> None:
    served = "/".join(precisions)
    console.print(
        f"[bold]{'step':>4} {'pub':>4} {'reward':>6}  {'served ' + served:<26} "
        f"{'stale':>7} {'409':>4} {'retry':>5}  {'publish':<17} {'pauses':<11} "
        f"{'secs':>5} k3 {served}[/bold]",
        highlight=False,
        soft_wrap=True,
    )


def print_step(console: Console, record: StepRecord, precisions: list[str]) -> None:
    served = " ".join(_versions(record.served.get(p, [])) for p in precisions)
    k3 = "/".join(f"{record.k3[p]:.4f}" if p in record.k3 else "-" for p in precisions)
    kind = "F" if record.kind == "full" else "D"
    publish = f"{kind} {_bytes(record.publish_bytes)} {record.publish_ratio:6.2%}"
    pauses = f"{record.pauses} {record.pause_s * 1000:.0f}ms"
    stale = f"{record.staleness_mean:.1f}/{record.staleness_max}"
    warn = f" [red]{record.violations} VIOLATIONS[/red]" if record.violations else ""
    failed = f" [yellow]{record.failed} failed[/yellow]" if record.failed else ""
    console.print(
        f"{record.step:>4} {'v' + str(record.version):>4} {record.reward:6.3f}  {served:<26} "
        f"{stale:>7} {record.retries_409:>4} {record.retries:>5}  {publish:<17} {pauses:<11} "
        f"{record.seconds:5.1f} {k3}{warn}{failed}",
        highlight=False,
        soft_wrap=True,
    )


def print_summary(console: Console, totals: DemoTotals, summary: dict[str, Any]) -> None:
    table = Table(title="Tether demo: summary", show_lines=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("steps", summary["steps"]),
        ("seconds", summary["seconds"]),
        ("mean reward, first 10 steps", f"{summary['reward_first10']:.3f}"),
        ("mean reward, last 10 steps", f"{summary['reward_last10']:.3f}"),
        ("versions published (full + delta)",
         f"{summary['versions_published']} ({summary['full_versions']} + "
         f"{summary['delta_versions']})"),
        ("bytes published", _bytes(summary["publish_bytes"])),
        ("mean delta size / full size", f"{summary['delta_ratio_mean']:.2%}"),
        ("rollouts (failed)", f"{summary['rollouts']} ({summary['failed_rollouts']})"),
        ("409 retries / all retries", f"{summary['retries_409']} / {summary['retries']}"),
        ("max staleness (versions)", summary["staleness_max"]),
        ("engine pauses (commits)", summary["engine_pauses"]),
        ("constraint violations", summary["constraint_violations"]),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, str(value))
    for precision, value in summary["k3_kl"].items():
        table.add_row(f"mean sampler/trainer k3 KL, {precision}", f"{value:.5f}")
    for precision, version in (summary.get("final_versions") or {}).items():
        table.add_row(f"final version served, {precision}", f"v{version}")
    console.print(table)
