"""Task validation: a task is usable only if its gold patch passes and no patch does not.

Scores the gold patch (every required test must pass), the empty patch (every
fail-to-pass test must not pass, else the task rewards doing nothing) and checks that
every named test id was collected (a mistyped id would make every patch 0). It only
calls `sandboxes.scoring.score`; it never changes the task.
"""

from __future__ import annotations

from sandboxes.scoring import SandboxFactory, ScoreResult, ScoreStatus, score
from sandboxes.task import Task


def task_problems(
    task: Task,
    gold_patch: str,
    *,
    sandbox_factory: SandboxFactory | None = None,
    python: str | None = None,
) -> list[str]:
    """What is wrong with `task`, one sentence each; empty when it is usable."""
    problems: list[str] = []
    gold = score(task, gold_patch, sandbox_factory=sandbox_factory, python=python)
    if gold.status is not ScoreStatus.PASS:
        problems.append(f"the gold patch scores {gold.status.value}: {gold.reason}")
    empty = score(task, "", sandbox_factory=sandbox_factory, python=python)
    if empty.status is ScoreStatus.INFRA_ERROR:
        problems.append(f"the empty patch could not be scored: {empty.reason}")
    else:
        passing = [t for t in task.fail_to_pass if empty.tests.get(t) == "passed"]
        if passing:
            problems.append(
                "fail-to-pass tests pass without any patch, so the task rewards doing "
                f"nothing: {', '.join(passing)}"
            )
    missing = sorted(_missing_ids(gold) | _missing_ids(empty))
    if missing:
        problems.append(
            f"test ids not collected by pytest (mistyped, or not in test_args): "
            f"{', '.join(missing)}"
        )
    return problems


def _missing_ids(result: ScoreResult) -> set[str]:
    return {test_id for test_id, outcome in result.tests.items() if outcome == "missing"}
