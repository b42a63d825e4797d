"""`tether sandbox ...`: score a coding-agent patch against a task; check local isolation.

Exit codes of `score`: 0 the patch was scored (reward 0 or 1 is in the output), 2 the task
file or patch is unusable, 3 an infrastructure failure (no reward: the environment failed).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Isolated test runs and coding-agent rewards.", no_args_is_help=True)
console = Console()
errors = Console(stderr=True)

EXIT_INVALID_INPUT = 2
EXIT_INFRA = 3


@app.command()
def score(
    task: Path = typer.Option(..., "--task", help="Task file (JSON)."),
    patch: Path = typer.Option(..., "--patch", help="The policy's patch (unified diff)."),
    unisolated: bool = typer.Option(
        False,
        "--unisolated",
        help="Run unisolated if bubblewrap is unusable (trusted code only).",
    ),
    python: str | None = typer.Option(None, help="Interpreter that runs the tests in the sandbox."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Apply PATCH to TASK's repository, run the required tests isolated, print the reward."""
    from sandboxes.base import SandboxSpec
    from sandboxes.errors import SandboxError
    from sandboxes.local import LocalSandbox
    from sandboxes.scoring import ScoreStatus
    from sandboxes.scoring import score as score_patch
    from sandboxes.task import load_task

    try:
        loaded = load_task(task)
        diff = patch.read_text()
    except (SandboxError, OSError, UnicodeDecodeError) as error:
        errors.print(f"[red]error:[/] {error}")
        raise typer.Exit(EXIT_INVALID_INPUT) from None

    def factory(spec: SandboxSpec) -> LocalSandbox:
        return LocalSandbox(spec, allow_unisolated=unisolated)

    with console.status(f"scoring {loaded.id}"):
        result = score_patch(loaded, diff, sandbox_factory=factory, python=python)
    if as_json:
        console.print_json(json.dumps(result.to_json()))
    else:
        table = Table(title=f"{loaded.id}: {result.status.value} (reward {result.reward})")
        table.add_column("required test")
        table.add_column("outcome")
        for test_id, outcome in sorted(result.tests.items()):
            colour = "green" if outcome == "passed" else "red"
            table.add_row(test_id, f"[{colour}]{outcome}[/]")
        console.print(table)
        if result.output_tail:
            # Test output is the task's text: printed verbatim, never read as rich markup.
            console.rule("tail of the test output")
            console.print(result.output_tail, markup=False, highlight=False)
            console.rule()
        console.print(f"{result.reason} [dim]({result.isolation}, {result.duration_s:.1f} s)[/]")
    if result.status is ScoreStatus.INFRA_ERROR:
        errors.print(f"[red]infrastructure failure, no reward:[/] {result.reason}")
        raise typer.Exit(EXIT_INFRA)


@app.command()
def check(
    task: Path | None = typer.Option(
        None, "--task", help="Validate this task instead: gold passes, empty fails, ids exist."
    ),
    gold: Path | None = typer.Option(
        None, "--gold", help="The task's reference fix (default: the task's gold_patch)."
    ),
    python: str | None = typer.Option(None, help="Interpreter that runs the tests in the sandbox."),
) -> None:
    """Report whether commands can be isolated here; with --task, validate that task."""
    if task is not None:
        _validate(task, gold, python)
        return
    from sandboxes.local import NONE, probe_isolation
    from sandboxes.modal_backend import modal_credentials_configured
    from sandboxes.settings import SandboxSettings

    report = probe_isolation(SandboxSettings().bwrap)
    table = Table(title="sandbox isolation")
    table.add_column("check")
    table.add_column("result")
    table.add_row("local isolation level", report.level)
    table.add_row("bubblewrap", report.bwrap or "missing")
    table.add_row("drops root to a leased uid", "yes" if report.drops_to_uid else "no (not root)")
    table.add_row("detail", report.detail)
    table.add_row("Modal credentials", "found" if modal_credentials_configured() else "none")
    console.print(table)
    if report.level == NONE:
        raise typer.Exit(1)


def _validate(task: Path, gold: Path | None, python: str | None) -> None:
    from rich.markup import escape

    from sandboxes.errors import SandboxError
    from sandboxes.task import load_task
    from sandboxes.validation import task_problems

    try:
        loaded = load_task(task)
        gold_patch = gold.read_text() if gold is not None else loaded.gold_patch
    except (SandboxError, OSError, UnicodeDecodeError) as error:
        errors.print(f"[red]error:[/] {error}")
        raise typer.Exit(EXIT_INVALID_INPUT) from None
    if not gold_patch.strip():
        errors.print(
            "[red]error:[/] no gold patch: pass --gold PATCH or set gold_patch in the task"
        )
        raise typer.Exit(EXIT_INVALID_INPUT)
    with console.status(f"validating {loaded.id}"):
        problems = task_problems(loaded, gold_patch, python=python)
    for problem in problems:
        errors.print(f"[red]task {escape(loaded.id)} is broken:[/] {escape(problem)}")
    if problems:
        raise typer.Exit(1)
    console.print(f"task {loaded.id} is valid: gold passes, fail-to-pass tests fail without it")
