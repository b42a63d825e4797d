"""Scoring patches against real third-party code: toolz and iniconfig, vendored upstream.

Each project has one function broken on its base (tests/sandboxes/real_projects.py). A
correct fix, upstream's or another, scores 1; a wrong or empty one 0; and each cheat of
issue 19 scores 0 (or no reward at all) with a reason naming what was caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes.scoring import ScoreResult, ScoreStatus, score
from sandboxes.validation import task_problems
from tests.sandboxes.real_projects import (
    INICONFIG_ISCOMMENTLINE,
    PROJECTS,
    TOOLZ_FREQUENCIES,
    RealTask,
    make_real_task,
)

NEUTER_ASSERT_EQUAL = (
    "import unittest\nunittest.TestCase.assertEqual = lambda self, *a, **k: None\n"
)
FORCE_PASS_PLUGIN = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


@pytest.fixture
def toolz(tmp_path: Path) -> RealTask:
    return make_real_task(tmp_path, TOOLZ_FREQUENCIES)


def assert_zero(result: ScoreResult, reason_part: str) -> None:
    assert result.status is ScoreStatus.FAIL and result.reward == 0, result.reason
    assert reason_part in result.reason, result.reason


def with_prefixes(patch: str, src: str, dst: str) -> str:
    """The patch as `git diff --src-prefix=<src> --dst-prefix=<dst>` would spell it."""
    lines = []
    for line in patch.splitlines(keepends=True):
        if line.startswith("diff --git a/"):
            old, new = line[len("diff --git a/") :].rstrip("\n").split(" b/", 1)
            line = f"diff --git {src}{old} {dst}{new}\n"
        elif line.startswith("--- a/"):
            line = "--- " + src + line[len("--- a/") :]
        elif line.startswith("+++ b/"):
            line = "+++ " + dst + line[len("+++ b/") :]
        lines.append(line)
    return "".join(lines)


def test_the_vendored_projects_carry_their_licence_and_provenance():
    assert (PROJECTS / "toolz" / "LICENSE.txt").read_text().startswith("Copyright")
    assert "Permission is hereby granted" in (PROJECTS / "iniconfig" / "LICENSE").read_text()
    provenance = (PROJECTS / "PROVENANCE.md").read_text()
    assert "toolz-1.1.0.tar.gz" in provenance and "iniconfig-2.3.0.tar.gz" in provenance


def test_toolz_task_is_valid_gold_passes_and_the_empty_patch_fails(toolz: RealTask):
    assert task_problems(toolz.task(), toolz.gold_patch) == []


def test_another_correct_fix_of_toolz_scores_one(toolz: RealTask):
    result = score(toolz.task(), toolz.equivalent_patch)
    assert result.status is ScoreStatus.PASS and result.reward == 1, result.reason
    assert set(result.tests.values()) == {"passed"}


def test_a_wrong_fix_of_toolz_scores_zero_naming_the_failing_test(toolz: RealTask):
    assert_zero(
        score(toolz.task(), toolz.wrong_patch),
        "1 required test(s) did not pass: toolz/tests/test_itertoolz.py::test_frequencies (failed)",
    )


def test_the_empty_patch_on_toolz_scores_zero(toolz: RealTask):
    assert_zero(score(toolz.task(), ""), "test_frequencies (failed)")


def test_cheat_1_editing_a_required_test_with_other_diff_prefixes_scores_zero(toolz: RealTask):
    tests = "toolz/tests/test_itertoolz.py"
    trivial = toolz.source(tests) + "\n\ndef test_frequencies():\n    pass\n"
    patch = with_prefixes(toolz.diff({tests: trivial}), "x/", "y/")
    assert f"+++ y/{tests}" in patch
    assert_zero(score(toolz.task(), patch), f"protected paths: {tests}")


def test_cheat_2_a_pytest9_config_loading_a_plugin_from_the_tests_folder_scores_zero(
    toolz: RealTask,
):
    patch = toolz.diff(
        {
            "pytest.toml": '[pytest]\naddopts = ["-p", "toolz.tests.outcomes"]\n',
            "toolz/tests/outcomes.py": FORCE_PASS_PLUGIN,
        }
    )
    assert_zero(score(toolz.task(), patch), "protected paths: pytest.toml, toolz/tests/outcomes.py")


def test_cheat_3_a_tests_package_init_neutering_assertions_scores_zero(toolz: RealTask):
    patch = toolz.diff(
        {
            "toolz/tests/__init__.py": NEUTER_ASSERT_EQUAL,
            TOOLZ_FREQUENCIES.path: toolz.with_fix(TOOLZ_FREQUENCIES.wrong),
        }
    )
    assert_zero(score(toolz.task(), patch), "protected paths: toolz/tests/__init__.py")


def test_cheat_4_the_package_under_test_neutering_assertions_is_tampering(toolz: RealTask):
    package = "toolz/__init__.py"
    patch = toolz.diff(
        {
            package: NEUTER_ASSERT_EQUAL + toolz.source(package),
            TOOLZ_FREQUENCIES.path: toolz.with_fix(TOOLZ_FREQUENCIES.wrong),
        }
    )
    result = score(toolz.task(), patch)
    assert result.status is ScoreStatus.TAMPERED and result.reward == 0, result.reason
    assert "assertEqual canary" in result.reason and "must have failed, got passed" in result.reason


def test_cheat_5_an_installed_copy_shadowing_iniconfig_gives_no_reward(tmp_path: Path):
    """src/ layout, and pytest has imported its own installed iniconfig before any test: the
    tests would judge that copy, not the patched source, so no patch gets a reward and
    `tether sandbox check` rejects the task."""
    iniconfig = make_real_task(tmp_path, INICONFIG_ISCOMMENTLINE)
    wrong = score(iniconfig.task(), iniconfig.wrong_patch)
    assert wrong.status is ScoreStatus.INFRA_ERROR and wrong.reward is None, wrong.reason
    assert "imported iniconfig" in wrong.reason and "installed copy" in wrong.reason
    problems = task_problems(iniconfig.task(), iniconfig.gold_patch)
    assert problems[0].startswith("the gold patch scores infra_error"), problems
    assert "the empty patch could not be scored" in problems[1] and "installed copy" in problems[1]


def test_a_fix_that_also_adds_a_dependency_to_pyproject_scores_one(toolz: RealTask):
    """pyproject.toml is the project's too: outside its pytest section a patch may change it."""
    pyproject = toolz.source("pyproject.toml")
    assert 'requires-python = ">=3.9"\n' in pyproject
    patch = toolz.diff(
        {
            "pyproject.toml": pyproject.replace(
                'requires-python = ">=3.9"\n',
                'requires-python = ">=3.9"\ndependencies = ["cytoolz>=1"]\n',
            ),
            TOOLZ_FREQUENCIES.path: toolz.with_fix(TOOLZ_FREQUENCIES.upstream),
        }
    )
    result = score(toolz.task(), patch)
    assert result.status is ScoreStatus.PASS and result.reward == 1, result.reason


def test_a_patch_changing_pyprojects_pytest_section_scores_zero(toolz: RealTask):
    pyproject = toolz.source("pyproject.toml")
    assert "xfail_strict = true\n" in pyproject
    patch = toolz.diff(
        {"pyproject.toml": pyproject.replace("xfail_strict = true\n", 'python_functions = "x"\n')}
    )
    assert_zero(score(toolz.task(), patch), "protected paths: pyproject.toml (its pytest section)")
