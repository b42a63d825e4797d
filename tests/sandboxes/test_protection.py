"""Paths named by a diff are found however git spells them, and protected ones are flagged."""

from __future__ import annotations

from pathlib import Path

from sandboxes.protection import (
    added_paths,
    numstat_paths,
    patch_paths,
    protected_violations,
    runner_sections,
    section_protected,
    status_paths,
    task_test_folders,
)
from sandboxes.task import Task

RENAMES = """diff --git a/src/old.py b/src/new.py
similarity index 90%
rename from src/old.py
rename to src/new.py
diff --git "a/sp ace/\\303\\251.py" "b/sp ace/\\303\\251.py"
--- "a/sp ace/\\303\\251.py"
+++ "b/sp ace/\\303\\251.py"
@@ -1 +1 @@
-a
+b
diff --git a/tests/test_new.py b/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/tests/test_new.py
@@ -0,0 +1 @@
+x
"""


def test_patch_paths_cover_renames_quoted_names_and_new_files():
    assert patch_paths(RENAMES) == {"src/old.py", "src/new.py", "sp ace/é.py", "tests/test_new.py"}
    assert added_paths(RENAMES) == {"tests/test_new.py"}


def test_plain_unified_diffs_without_git_headers_are_understood():
    plain = "--- a/pkg/m.py\t2020-01-01\n+++ b/pkg/m.py\t2020-01-01\n@@ -1 +1 @@\n-a\n+b\n"
    assert patch_paths(plain) == {"pkg/m.py"}


def test_protected_paths_include_test_files_runner_hooks_and_task_globs():
    task = Task(
        id="t",
        repo=Path("."),
        base_commit="abcd",
        fail_to_pass=["tests/test_a.py::test_x"],
        test_patch=RENAMES,
        protected_paths=["docs/*"],
    )
    touched = {
        "src/fix.py",
        "tests/test_a.py",
        "tests/test_new.py",
        "deep/conftest.py",
        "sub/pytest.toml",
        "x.pth",
        "docs/a.md",
        ".git/config",
    }
    assert protected_violations(task, touched) == sorted(touched - {"src/fix.py"})


def test_any_first_path_component_is_stripped_as_git_apply_does():
    spelled = "--- x/tests/t.py\n+++ y/tests/t.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert patch_paths(spelled) == {"tests/t.py"}


def test_git_status_and_numstat_outputs_name_every_path_git_changed():
    porcelain = " M src/m.py\0?? tests/__init__.py\0R  new.py\0old.py\0!! pytest.toml\0"
    assert status_paths(porcelain) == {
        "src/m.py": " M",
        "tests/__init__.py": "??",
        "new.py": "R ",
        "old.py": "R ",
        "pytest.toml": "!!",
    }
    assert numstat_paths("1\t0\tsrc/m.py\0" + "0\t0\t\0old.py\0new.py\0") == {
        "src/m.py",
        "old.py",
        "new.py",
    }


def test_test_folders_are_the_nearest_test_named_ancestors_of_the_task_tests():
    task = Task(
        id="t",
        repo=Path("."),
        base_commit="abcd",
        fail_to_pass=["tests/unit/test_a.py::t", "pkg/test_b.py::t", "src/testing/x/c.py::t"],
    )
    assert task_test_folders(task) == {"tests", "src/testing"}
    touched = {"tests/unit/__init__.py", "pkg/b.py", "tests/x.py", "src/testing/y.py"}
    assert protected_violations(task, touched) == sorted(touched - {"pkg/b.py"})


def test_only_the_pytest_sections_of_pyproject_and_setup_cfg_count():
    base = '[project]\nname = "p"\n\n[tool.pytest.ini_options]\naddopts = "-q"\n'
    with_dependency = base.replace('name = "p"\n', 'name = "p"\ndependencies = ["x"]\n')
    assert runner_sections("pyproject.toml", base) == runner_sections(
        "pyproject.toml", with_dependency
    )
    for changed in (
        base.replace('"-q"', '"-p plugin"'),
        base + '\n[tool.pytest]\naddopts = ["-p", "plugin"]\n',
        "not toml [",
    ):
        assert runner_sections("pyproject.toml", base) != runner_sections("pyproject.toml", changed)
    assert runner_sections("pyproject.toml", None) is None
    cfg = "[metadata]\nname = p\n\n[tool:pytest]\naddopts = -q\n"
    assert runner_sections("setup.cfg", cfg) == runner_sections(
        "setup.cfg", cfg.replace("name = p", "name = q")
    )
    assert runner_sections("setup.cfg", cfg) != runner_sections(
        "setup.cfg", cfg.replace("-q", "-p plugin")
    )


def test_pyproject_and_setup_cfg_are_not_refused_by_name_alone():
    task = Task(id="t", repo=Path("."), base_commit="abcd", fail_to_pass=["tests/t.py::t"])
    assert protected_violations(task, {"pyproject.toml", "setup.cfg", "pkg/mod.py"}) == []
    assert section_protected({"pyproject.toml", "sub/setup.cfg", "pkg/mod.py"}) == [
        "pyproject.toml",
        "sub/setup.cfg",
    ]
