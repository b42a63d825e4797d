"""A small, real SWE-style task built on disk: a git repository with a bug and its tests.

Used by the benchmark, the tests and `docs/sandboxes.md` to show a full scoring round
without downloading anything. Owns only the example's content; it never scores.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandboxes.snapshot import SNAPSHOT_IDENTITY
from sandboxes.task import Task, load_task

OPS_BUGGY = '''"""Arithmetic the tests check."""


def add(a, b):
    return a - b


def sub(a, b):
    return a - b
'''
OPS_FIXED = OPS_BUGGY.replace("return a - b\n\n\ndef sub", "return a + b\n\n\ndef sub")
OPS_WRONG = OPS_BUGGY.replace("return a - b\n\n\ndef sub", "return a * b\n\n\ndef sub")
TESTS_BASE = """from calc.ops import sub


def test_sub():
    assert sub(5, 3) == 2


class TestSubMore:
    def test_negative(self):
        assert sub(1, 3) == -2
"""
TESTS_WITH_ADD = (
    TESTS_BASE.replace("from calc.ops import sub\n", "from calc.ops import add, sub\n")
    + """

def test_add():
    assert add(2, 3) == 5
    assert add(-1, 1) == 0
"""
)


@dataclass(frozen=True)
class ExampleTask:
    """The task file and three patches: the fix, a wrong fix, and one adding a new file."""

    repo: Path
    task_path: Path
    base_commit: str
    gold_patch: str
    wrong_patch: str

    def task(self) -> Task:
        return load_task(self.task_path)


def git(repo: Path, *args: str) -> str:
    """Run git in `repo` with a fixed identity; return stdout."""
    return subprocess.run(
        ["git", "-c", "commit.gpgsign=false", *args],
        cwd=repo,
        env={"PATH": "/usr/bin:/bin", "HOME": str(repo), **SNAPSHOT_IDENTITY},
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def diff_of(repo: Path, changes: dict[str, str]) -> str:
    """The `git diff` that turns the checked-out tree into one with `changes`; tree unchanged."""
    for path, text in changes.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    git(repo, "add", "-A", "-N", ".")
    patch = git(repo, "diff", "--binary")
    git(repo, "reset", "-q", "--hard")
    git(repo, "clean", "-q", "-fdx")
    return patch


def make_example_task(root: Path, name: str = "calc", **task_fields: object) -> ExampleTask:
    """Create `root/<name>/` (repository) and `root/<name>.json` (task) and return both."""
    repo = root / name
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text(OPS_BUGGY)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_ops.py").write_text(TESTS_BASE)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    test_patch = diff_of(repo, {"tests/test_ops.py": TESTS_WITH_ADD})
    fields: dict[str, object] = {
        "id": name,
        "repo": name,
        "base_commit": base,
        "fail_to_pass": ["tests/test_ops.py::test_add"],
        "pass_to_pass": [
            "tests/test_ops.py::test_sub",
            "tests/test_ops.py::TestSubMore::test_negative",
        ],
        "test_args": ["tests/test_ops.py"],
        "test_patch": test_patch,
        "timeout_s": 60,
    }
    fields.update(task_fields)
    task_path = root / f"{name}.json"
    task_path.write_text(json.dumps(fields, indent=2))
    return ExampleTask(
        repo=repo,
        task_path=task_path,
        base_commit=base,
        gold_patch=diff_of(repo, {"calc/ops.py": OPS_FIXED}),
        wrong_patch=diff_of(repo, {"calc/ops.py": OPS_WRONG}),
    )
