"""Which paths a policy patch may not touch, and the paths a unified diff touches.

The reward is 0 when a patch touches a protected path: the task's test files (every path
of its test patch and of its required test ids) and the test folders holding them (the
nearest enclosing folder named like `test*`, so `tests/__init__.py` is covered), files
pytest loads on its own
(`conftest.py`, pytest/tox configuration), interpreter start-up hooks (`sitecustomize.py`,
`usercustomize.py`, `*.pth`) and bytecode (`__pycache__`, `*.pyc`), which Python may load
instead of a restored source. `pyproject.toml` and `setup.cfg` also hold what is not the
test runner's (a dependency, package metadata): only their pytest sections are protected,
compared parsed before and after the patch. What a patch touches is judged twice: from the
diff's text, and from git's own account of the tree after applying it (`git status -z`,
`git apply --numstat -z`), so no spelling of the diff's paths (prefixes other than a/ b/)
slips by. This module only reads text; it never applies a diff or runs git.
"""

from __future__ import annotations

import configparser
import fnmatch
import json
import posixpath
import re
import tomllib

from sandboxes.task import Task

ALWAYS_PROTECTED_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
ALWAYS_PROTECTED_SUFFIXES = (".pth", ".pyc", ".pyo")
# Files whose pytest sections only are protected (the rest is the project's to change).
SECTION_PROTECTED_NAMES = frozenset({"pyproject.toml", "setup.cfg"})

_GIT_HEADER = re.compile(r'^diff --git (?P<a>"(?:[^"\\]|\\.)*"|\S+) (?P<b>"(?:[^"\\]|\\.)*"|\S+)$')
_NAME_LINES = ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to ")


def _unquote(name: str) -> str:
    if len(name) >= 2 and name[0] == name[-1] == '"':
        raw = name[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        return raw.encode("latin-1", "replace").decode("utf-8", "replace")
    return name


def strip_diff_name(name: str) -> str | None:
    """A path as `git apply` reads a diff header: unquoted, first component stripped.

    Git strips the first component whatever it is (`x/`, `y/`, not only `a/` `b/`), so this
    does too; None for /dev/null.
    """
    name = _unquote(name.split("\t", 1)[0].strip())
    if name == "/dev/null":
        return None
    if "/" in name:
        name = name.split("/", 1)[1]
    return name


def patch_paths(diff: str) -> set[str]:
    """Every path a unified or git diff names, old and new sides, as git apply -p1 reads it."""
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


def task_test_folders(task: Task) -> set[str]:
    """Folders holding the task's test files: the nearest ancestor named `test*` of each.

    A test file beside the code (`pkg/test_m.py`) protects only itself, so a fix to
    `pkg/m.py` stays allowed.
    """
    folders = set()
    for path in protected_test_files(task):
        parts = path.split("/")[:-1]
        for depth in range(len(parts), 0, -1):
            if parts[depth - 1].lower().startswith("test"):
                folders.add("/".join(parts[:depth]))
                break
    return folders


def status_paths(porcelain_z: str) -> dict[str, str]:
    """Path → status code from `git status --porcelain=v1 -z` (renames give both paths)."""
    entries: dict[str, str] = {}
    fields = porcelain_z.split("\0")
    index = 0
    while index < len(fields):
        entry = fields[index]
        index += 1
        if len(entry) < 4:
            continue
        code, path = entry[:2], entry[3:]
        entries[posixpath.normpath(path)] = code
        if "R" in code or "C" in code:
            if index < len(fields) and fields[index]:
                entries[posixpath.normpath(fields[index])] = code
            index += 1
    return entries


def numstat_paths(numstat_z: str) -> set[str]:
    """Paths from `git apply --numstat -z` (a rename lists its old and new path)."""
    paths: set[str] = set()
    fields = numstat_z.split("\0")
    index = 0
    while index < len(fields):
        entry = fields[index]
        index += 1
        columns = entry.split("\t")
        if len(columns) != 3:
            continue
        if columns[2]:
            paths.add(posixpath.normpath(columns[2]))
            continue
        # A rename or copy: the names follow in the next two fields.
        for name in fields[index : index + 2]:
            if name:
                paths.add(posixpath.normpath(name))
        index += 2
    return paths


def protected_violations(task: Task, touched: set[str]) -> list[str]:
    """The touched paths the policy was not allowed to change, sorted."""
    tests = protected_test_files(task)
    folders = task_test_folders(task)
    bad = []
    for path in touched:
        name = posixpath.basename(path)
        if (
            path in tests
            or any(path == folder or path.startswith(folder + "/") for folder in folders)
            or name in ALWAYS_PROTECTED_NAMES
            or name.endswith(ALWAYS_PROTECTED_SUFFIXES)
            or "__pycache__" in path.split("/")
            or path == ".git"
            or path.startswith(".git/")
            or any(fnmatch.fnmatch(path, pattern) for pattern in task.protected_paths)
        ):
            bad.append(path)
    return sorted(bad)


def runner_sections(name: str, text: str | None) -> str | None:
    """The test runner's sections of a `pyproject.toml` or `setup.cfg`, canonical JSON.

    pyproject.toml: `[tool.pytest]` (with `ini_options`, and pytest 9's native table);
    setup.cfg: `[tool:pytest]` and `[pytest]`. None for a missing file; a file that does not
    parse is its own text, so any change to it counts.
    """
    if text is None:
        return None
    try:
        if name == "pyproject.toml":
            sections: object = tomllib.loads(text).get("tool", {}).get("pytest")
        else:
            parser = configparser.RawConfigParser(strict=False)
            parser.read_string(text)
            sections = {
                section: dict(parser.items(section))
                for section in ("tool:pytest", "pytest")
                if parser.has_section(section)
            }
    except (tomllib.TOMLDecodeError, configparser.Error, AttributeError):
        return "unparsable: " + text
    return json.dumps(sections, sort_keys=True, default=str)


def section_protected(touched: set[str]) -> list[str]:
    """The touched files whose pytest sections must be compared before and after, sorted."""
    return sorted(p for p in touched if posixpath.basename(p) in SECTION_PROTECTED_NAMES)


def runner_pathspecs() -> list[str]:
    """git pathspecs of every file pytest or Python loads on its own, wherever it lies."""
    names = [*sorted(ALWAYS_PROTECTED_NAMES), *(f"*{s}" for s in ALWAYS_PROTECTED_SUFFIXES)]
    return [f":(glob)**/{name}" for name in names]
