"""The static harness guard: what it flags in a patch, where, and what it lets through."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes.example import OPS_BUGGY, ExampleTask, diff_of, make_example_task
from sandboxes.harness_guard import harness_reaches, is_test_file
from sandboxes.task import Task


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> ExampleTask:
    return make_example_task(tmp_path_factory.mktemp("guard"))


def source_patch(example: ExampleTask, body: str, path: str = "calc/ops.py") -> str:
    """A patch replacing add()'s body in calc/ops.py (or adding `path` with `body`)."""
    edited = path == "calc/ops.py"
    text = OPS_BUGGY.replace("    return a - b", body, 1) if edited else body + "\n"
    return diff_of(example.repo, {path: text})


def test_the_gold_patch_reaches_nothing(repo: ExampleTask):
    assert harness_reaches(repo.gold_patch) == []


ORDINARY_FIX = """    import argparse
    import gc
    import inspect
    import os
    import sys

    gc.collect()
    if inspect.signature(add).parameters and os.environ.get("CALC_DEBUG"):
        print("adding", a, b, file=sys.stderr)
        sys.exit(argparse.ArgumentParser().prog and 0)
    return a + b"""


def test_an_ordinary_fix_using_os_sys_gc_and_inspect_passes(repo: ExampleTask):
    assert harness_reaches(source_patch(repo, ORDINARY_FIX)) == []


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("    import _pytest.runner", "pytest internals"),
        ("    from _pytest.reports import TestReport", "pytest internals"),
        ("    import pytest", "pytest import"),
        ("    hook = 'pytest_runtest_makereport'", "pytest hooks"),
        ("    import pluggy", "pluggy"),
        ("    open('junit.xml', 'w')", "JUnit report"),
        ("    path = sys.argv[-1]", "command line"),
        ("    os._exit(0)", "hard exit"),
        ("    frame = sys._getframe(3)", "frame walking"),
        ("    caller = inspect.stack()[2]", "frame walking"),
        ("    up = frame.f_back.f_back", "frame walking"),
        ("    objs = gc.get_objects()", "gc walking"),
        ("    open('/proc/self/cmdline').read()", "own process internals"),
    ],
)
def test_each_reach_into_the_harness_is_named_with_file_line_and_rule(
    repo: ExampleTask, line: str, rule: str
):
    found = harness_reaches(source_patch(repo, line + "\n    return a + b"))
    assert len(found) == 1, found
    reach = found[0]
    assert (reach.path, reach.line, reach.rule) == ("calc/ops.py", 5, rule)
    assert reach.describe() == f"calc/ops.py:+5 {line.strip()!r} ({rule})"


def test_line_numbers_count_the_new_file_across_hunks(repo: ExampleTask):
    text = OPS_BUGGY.replace('"""Arithmetic the tests check."""', "import os", 1)
    text = text.replace("def sub(a, b):\n    return a - b", "def sub(a, b):\n    os._exit(0)")
    found = harness_reaches(diff_of(repo.repo, {"calc/ops.py": text}))
    assert [(r.line, r.rule) for r in found] == [(9, "hard exit")]


def test_new_source_files_are_guarded_too(repo: ExampleTask):
    found = harness_reaches(source_patch(repo, "import _pytest", path="calc/hooks.py"))
    assert [(r.path, r.line) for r in found] == [("calc/hooks.py", 1)]


def test_test_files_may_use_pytest_freely(repo: ExampleTask):
    for path in ("tests/test_more.py", "calc/test_more.py", "calc/more_test.py"):
        assert harness_reaches(source_patch(repo, "import pytest", path=path)) == []


HAND_WRITTEN = """diff --git a/calc/ops.py b/calc/ops.py
--- a/calc/ops.py
+++ b/calc/ops.py
@@ -1,3 +1,3 @@
-import pytest
 ARGS = sys.argv
+++ GC = gc.get_objects()
 X = 1
"""


def test_only_added_lines_count_even_when_they_look_like_headers():
    found = harness_reaches(HAND_WRITTEN)
    assert [(r.path, r.line, r.rule) for r in found] == [("calc/ops.py", 2, "gc walking")]


def test_is_test_file_knows_the_usual_layouts():
    assert is_test_file("tests/unit/helpers.py") and is_test_file("pkg/test_x.py")
    assert not is_test_file("pkg/testsuite.py") and not is_test_file("contest/ops.py")


def test_the_guard_is_a_task_field_on_by_default(tmp_path: Path):
    task = make_example_task(tmp_path).task()
    assert task.harness_guard is True
    assert Task.model_validate({**task.model_dump(), "harness_guard": False}).harness_guard is False
