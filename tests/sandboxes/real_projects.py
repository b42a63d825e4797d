"""Tasks built from vendored third-party projects (tests/sandboxes/projects/), for real scoring.

Each project's upstream sources are copied into a fresh git repository, one function is
broken and committed as the task's base, and the patches a policy might send are made with
real `git diff`: the upstream fix (gold), another correct fix, a wrong fix, and the issue's
cheats. Owns only these tasks' content; it never scores.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from sandboxes.example import diff_of, git
from sandboxes.task import Task, load_task

PROJECTS = Path(__file__).parent / "projects"


@dataclass(frozen=True)
class Breakage:
    """One function of a vendored project, broken on the base, and fixes for it."""

    project: str
    path: str  # the file holding the function
    upstream: str  # the function's upstream text (the gold fix restores it)
    broken: str  # what the base has instead
    equivalent: str  # another correct fix
    wrong: str  # a fix that still fails the fail-to-pass tests
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_args: tuple[str, ...]


TOOLZ_FREQUENCIES = Breakage(
    project="toolz",
    path="toolz/itertoolz.py",
    upstream="    d = collections.defaultdict(int)\n    for item in seq:\n        d[item] += 1\n",
    broken="    d = collections.defaultdict(int)\n    for item in seq:\n        d[item] = 1\n",
    equivalent="    d = collections.Counter()\n    for item in seq:\n        d[item] += 1\n",
    wrong="    d = collections.defaultdict(int)\n    for item in set(seq):\n        d[item] += 1\n",
    fail_to_pass=("toolz/tests/test_itertoolz.py::test_frequencies",),
    pass_to_pass=(
        "toolz/tests/test_itertoolz.py::test_reduceby",
        "toolz/tests/test_itertoolz.py::test_groupby",
    ),
    test_args=("toolz/tests/test_itertoolz.py",),
)

# iniconfig is a dependency of pytest itself: pytest has imported the installed copy before
# any test runs, so in an interpreter with pytest the tests never see the patched source.
INICONFIG_ISCOMMENTLINE = Breakage(
    project="iniconfig",
    path="src/iniconfig/_parse.py",
    upstream="    c = line.lstrip()[:1]\n    return c in COMMENTCHARS\n",
    broken="    c = line.lstrip()[:1]\n    return c == '#'\n",
    equivalent="    return line.lstrip().startswith(tuple(COMMENTCHARS))\n",
    wrong="    return line[:1] in COMMENTCHARS\n",
    fail_to_pass=("testing/test_iniconfig.py::test_iscommentline_true[;qwe]",),
    pass_to_pass=("testing/test_iniconfig.py::test_iscommentline_true[#qwe]",),
    test_args=("testing/test_iniconfig.py",),
)


@dataclass(frozen=True)
class RealTask:
    """A task over a vendored project's base, and its patches as `git diff` made them."""

    breakage: Breakage
    repo: Path
    task_path: Path
    gold_patch: str
    equivalent_patch: str
    wrong_patch: str

    def task(self) -> Task:
        return load_task(self.task_path)

    def source(self, path: str) -> str:
        return (self.repo / path).read_text()

    def diff(self, changes: dict[str, str]) -> str:
        """A `git diff` of the base with `changes` (path → full new text)."""
        return diff_of(self.repo, changes)

    def with_fix(self, fix: str) -> str:
        """The broken file's text with `fix` in place of the broken lines."""
        return self.source(self.breakage.path).replace(self.breakage.broken, fix, 1)


def make_real_task(root: Path, breakage: Breakage) -> RealTask:
    """Copy the vendored project to `root/<project>/`, break it, commit, and write the task."""
    repo = root / breakage.project
    shutil.copytree(PROJECTS / breakage.project, repo, ignore=shutil.ignore_patterns("__pycache__"))
    target = repo / breakage.path
    text = target.read_text()
    if breakage.upstream not in text:
        raise ValueError(f"{breakage.path} does not hold the upstream lines to break")
    target.write_text(text.replace(breakage.upstream, breakage.broken, 1))
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"{breakage.project}: base with a broken function")
    base = git(repo, "rev-parse", "HEAD").strip()
    task_path = root / f"{breakage.project}.json"
    task_path.write_text(
        json.dumps(
            {
                "id": f"{breakage.project}-real",
                "repo": breakage.project,
                "base_commit": base,
                "fail_to_pass": list(breakage.fail_to_pass),
                "pass_to_pass": list(breakage.pass_to_pass),
                "test_args": list(breakage.test_args),
                "timeout_s": 120,
            }
        )
    )
    broken = target.read_text()

    def fixed_by(lines: str) -> str:
        return diff_of(repo, {breakage.path: broken.replace(breakage.broken, lines, 1)})

    return RealTask(
        breakage=breakage,
        repo=repo,
        task_path=task_path,
        gold_patch=fixed_by(breakage.upstream),
        equivalent_patch=fixed_by(breakage.equivalent),
        wrong_patch=fixed_by(breakage.wrong),
    )
