"""Which paths a policy patch may not touch, and the paths a unified diff touches.

The reward is 0 when a patch touches a protected path: the task's test files (every path
of its test patch and of its required test ids), files pytest loads on its own
(`conftest.py`, pytest/tox configuration), interpreter start-up hooks (`sitecustomize.py`,
`usercustomize.py`, `*.pth`) and bytecode (`__pycache__`, `*.pyc`), which Python may load
instead of a restored source. This module only reads diff text; it never applies one.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re

from sandboxes.task import Task

ALWAYS_PROTECTED_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
ALWAYS_PROTECTED_SUFFIXES = (".pth", ".pyc", ".pyo")

_GIT_HEADER = re.compile(r'^diff --git (?P<a>"(?:[^"\\]|\\.)*"|\S+) (?P<b>"(?:[^"\\]|\\.)*"|\S+)$')
_NAME_LINES = ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to ")


def _unquote(name: str) -> str:
    if len(name) >= 2 and name[0] == name[-1] == '"':
        raw = name[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        return raw.encode("latin-1", "replace").decode("utf-8", "replace")
    return name


def strip_diff_name(name: str) -> str | None:
    """A path as a diff header names it: unquoted, without a/ b/; None for /dev/null."""
    name = _unquote(name.split("\t", 1)[0].strip())
    if name == "/dev/null":
        return None
    if name[:2] in ("a/", "b/"):
        name = name[2:]
    return name


def patch_paths(diff: str) -> set[str]:
    """Every path a unified or git diff names, old and new sides, without a/ b/ prefixes."""
    paths: set[str] = set()
    for line in diff.splitlines():
        header = _GIT_HEADER.match(line)
        candidates: list[str] = []
        if header:
            candidates = [header["a"], header["b"]]
        else:
            for lead in _NAME_LINES:
                if line.startswith(lead):
                    value = line[len(lead) :]
                    if lead.startswith(("rename", "copy")):
                        value = "a/" + value
                    candidates = [value]
                    break
        for candidate in candidates:
            path = strip_diff_name(candidate)
            if path:
                paths.add(posixpath.normpath(path))
    return paths


def added_paths(diff: str) -> set[str]:
    """Paths a diff creates (its old side is /dev/null)."""
    added: set[str] = set()
    previous = ""
    for line in diff.splitlines():
        if line.startswith("+++ ") and previous.startswith("--- /dev/null"):
            path = strip_diff_name(line[4:])
            if path:
                added.add(posixpath.normpath(path))
        previous = line
    return added


def protected_test_files(task: Task) -> set[str]:
    """The task's own test files: from its test patch and its required test ids."""
    files = patch_paths(task.test_patch)
    files |= {test_id.split("::", 1)[0] for test_id in task.required}
    return {posixpath.normpath(path) for path in files}


def protected_violations(task: Task, touched: set[str]) -> list[str]:
    """The touched paths the policy was not allowed to change, sorted."""
    tests = protected_test_files(task)
    bad = []
    for path in touched:
        name = posixpath.basename(path)
        if (
            path in tests
            or name in ALWAYS_PROTECTED_NAMES
            or name.endswith(ALWAYS_PROTECTED_SUFFIXES)
            or "__pycache__" in path.split("/")
            or path == ".git"
            or path.startswith(".git/")
            or any(fnmatch.fnmatch(path, pattern) for pattern in task.protected_paths)
        ):
            bad.append(path)
    return sorted(bad)
