"""Scoring real patches against a real repository: rewards are right and attacks score 0."""

from __future__ import annotations

import base64
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from sandboxes.errors import InvalidTask
from sandboxes.example import OPS_BUGGY, OPS_FIXED, ExampleTask, diff_of, git, make_example_task
from sandboxes.pytest_plugin import COLLECTED, FINAL, RECORD_PREFIX, TEST, read_records, sign
from sandboxes.scoring import ScoreStatus, score
from sandboxes.task import load_task

FAST = {"timeout_s": 20}


def ops_with(prelude: str, add_body: str = "return a - b") -> str:
    """calc/ops.py with code run at import and a replacement body for add()."""
    return prelude + "\n" + OPS_BUGGY.replace("return a - b", add_body, 1)


def score_change(example: ExampleTask, changes: dict[str, str], **task_update):
    patch = diff_of(example.repo, changes)
    task = example.task().model_copy(update=task_update)
    return score(task, patch)


def assert_zero(result, reason_part: str) -> None:
    assert result.status is ScoreStatus.FAIL, result.reason
    assert result.reward == 0
    assert reason_part in result.reason, result.reason


def test_correct_patch_scores_one(example: ExampleTask):
    result = score(example.task(), example.gold_patch)
    assert result.status is ScoreStatus.PASS and result.reward == 1, result.reason
    assert set(result.tests.values()) == {"passed"}
    assert result.isolation == "bwrap"


def test_wrong_patch_scores_zero(example: ExampleTask):
    result = score(example.task(), example.wrong_patch)
    assert_zero(result, "did not pass")
    assert result.tests["tests/test_ops.py::test_add"] == "failed"


def test_empty_patch_scores_zero(example: ExampleTask):
    assert_zero(score(example.task(), ""), "tests/test_ops.py::test_add (failed)")


def test_a_task_given_as_a_git_bundle_scores_like_its_folder(example: ExampleTask, tmp_path: Path):
    bundle = tmp_path / "calc.bundle"
    git(example.repo, "bundle", "create", str(bundle), "--all")
    task = example.task().model_copy(update={"repo": bundle})
    assert score(task, example.gold_patch).reward == 1


CHEATING_CONFTEST = """
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""


def test_a_patch_adding_a_cheating_conftest_scores_zero(example: ExampleTask):
    for where in ("conftest.py", "calc/conftest.py"):
        result = score_change(example, {where: CHEATING_CONFTEST})
        assert_zero(result, f"protected paths: {where}")


def test_the_cheating_conftest_is_caught_even_where_no_path_protects_against_it(
    example: ExampleTask,
):
    """Placed by the task itself (not the patch), the report rewriter turns the failing
    tests into passes in pytest's reports; the recorder saw the calls raise."""
    (example.repo / "conftest.py").write_text(CHEATING_CONFTEST)
    git(example.repo, "add", "conftest.py")
    git(example.repo, "commit", "-q", "-m", "cheat")
    base = git(example.repo, "rev-parse", "HEAD").strip()
    task = example.task().model_copy(update={"base_commit": base})
    assert_zero(score(task, ""), "but the plugin recorded failed; treating as forged")


def test_a_patch_editing_a_required_test_scores_zero(example: ExampleTask):
    trivial = "def test_sub():\n    pass\n\n\ndef test_add():\n    pass\n"
    assert_zero(score_change(example, {"tests/test_ops.py": trivial}), "tests/test_ops.py")


def test_startup_hooks_and_bytecode_are_protected(example: ExampleTask):
    for path in ("calc/sitecustomize.py", "evil.pth", "calc/__pycache__/ops.cpython-311.pyc"):
        assert_zero(score_change(example, {path: "x = 1\n"}), "protected paths")


def test_a_patch_escaping_the_repository_scores_zero(example: ExampleTask):
    escaping = OPS_FIXED and (
        "diff --git a/../escape.py b/../escape.py\nnew file mode 100644\n"
        "--- /dev/null\n+++ b/../escape.py\n@@ -0,0 +1 @@\n+x = 1\n"
    )
    assert_zero(score(example.task(), escaping), "does not apply")
    assert not (example.repo.parent / "escape.py").exists()


def test_a_patch_writing_through_a_symlink_scores_zero(example: ExampleTask):
    (example.repo / "link").symlink_to("/tmp")
    git(example.repo, "add", "link")
    git(example.repo, "commit", "-q", "-m", "link")
    base = git(example.repo, "rev-parse", "HEAD").strip()
    through = (
        "diff --git a/link/planted.txt b/link/planted.txt\nnew file mode 100644\n"
        "--- /dev/null\n+++ b/link/planted.txt\n@@ -0,0 +1 @@\n+x\n"
    )
    result = score(example.task().model_copy(update={"base_commit": base}), through)
    assert_zero(result, "does not apply")


def test_a_patch_that_does_not_apply_scores_zero(example: ExampleTask):
    broken = example.gold_patch.replace("return a - b", "return a ^ b", 1)
    assert_zero(score(example.task(), broken), "does not apply")


def test_a_patch_fetching_the_answer_over_the_network_scores_zero(example: ExampleTask):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def answer() -> None:
            server.settimeout(30)
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"a + b")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        body = (
            "import socket\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "    return eval(s.recv(100).decode())"
        )
        result = score_change(example, {"calc/ops.py": ops_with("", body)})
        # Unblock the server thread: connect ourselves to show the server was reachable here.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
            assert probe.recv(100) == b"a + b"
        thread.join(timeout=10)
    assert_zero(result, "did not pass")


def test_a_fork_bomb_scores_zero_and_is_cleaned_up(example: ExampleTask):
    bomb = (
        "import os\n    while True:\n        try:\n            os.fork()\n"
        "        except OSError:\n            pass"
    )
    result = score_change(example, {"calc/ops.py": ops_with("", bomb)}, timeout_s=4)
    assert_zero(result, "did not finish")


def test_printing_gigabytes_scores_zero_quickly(example: ExampleTask):
    flood = (
        "import os\n    for _ in range(1 << 14):\n"
        "        os.write(1, b'y' * (1 << 20))\n    return a + b"
    )
    result = score_change(example, {"calc/ops.py": ops_with("", flood)})
    assert result.reward == 0, result.reason
    assert result.duration_s < 60
    assert len(result.output_tail) <= 2000


def test_sleeping_forever_scores_zero_at_the_timeout(example: ExampleTask):
    sleeper = "import time\n    time.sleep(10 ** 6)"
    result = score_change(example, {"calc/ops.py": ops_with("", sleeper)}, timeout_s=3)
    assert_zero(result, "did not finish within 3 s")


FORGER = """import atexit, glob, os, sys

print("PASSED tests/test_ops.py::test_add")
FORGED = (
    '<testsuites><testsuite name="%s" tests="3">'
    '<testcase file="tests/test_ops.py" classname="tests.test_ops" name="test_add"/>'
    '<testcase file="tests/test_ops.py" classname="tests.test_ops" name="test_sub"/>'
    '<testcase file="tests/test_ops.py" classname="tests.test_ops.TestSubMore"'
    ' name="test_negative"/>'
    '</testsuite></testsuites>'
)


def _forge():
    nonce = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("junit_suite_name=")), "x")
    target = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml=")), None)
    for path in [target, "report.xml", "/tmp/report/junit.xml", *glob.glob("/tmp/report/*")]:
        if path:
            with open(path, "w") as handle:
                handle.write(FORGED % nonce)


atexit.register(_forge)
"""


def test_forged_prints_and_junit_reports_score_zero(example: ExampleTask):
    result = score_change(example, {"calc/ops.py": ops_with(FORGER)}, harness_guard=False)
    assert_zero(result, "does not carry this run's nonce")


ARGV_EXIT_FORGER = FORGER.replace(
    "atexit.register(_forge)\n", "_forge()\nsys.stdout.flush()\nos._exit(0)\n"
)


def test_a_forger_reading_the_command_line_finds_no_secret_there(example: ExampleTask):
    """The old hole: read report path and nonce from argv, forge, exit 0 before pytest can."""
    changes = {"calc/ops.py": ops_with(ARGV_EXIT_FORGER)}
    result = score_change(example, changes, harness_guard=False)
    assert_zero(result, "the test run wrote no report (exit code 0)")


GC_EXIT_FORGER = (
    FORGER.split("\n\ndef _forge")[0]
    + """

def _forge():
    import gc

    config = next(o for o in gc.get_objects() if type(o).__name__ == "Config")
    with open(config.option.xmlpath, "w") as handle:
        handle.write(FORGED % config.getini("junit_suite_name"))
    sys.stdout.flush()
    os._exit(0)


_forge()
"""
)


def test_a_forger_that_finds_the_secrets_in_memory_and_exits_early_scores_zero(
    example: ExampleTask,
):
    """Walking gc defeats the secret channel; dying before pytest's session end does not pay."""
    changes = {"calc/ops.py": ops_with(GC_EXIT_FORGER)}
    result = score_change(example, changes, harness_guard=False)
    assert_zero(result, "no final record from the scorer's plugin")
    guarded = score_change(example, changes)
    assert_zero(guarded, "patch reaches into the test harness: calc/ops.py:+")
    assert "(gc walking)" in guarded.reason and "(hard exit)" in guarded.reason


OUTCOME_REWRITER = """import gc

import pytest


class _Cheat:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome = "passed"
        report.longrepr = None


for _found in gc.get_objects():
    if type(_found).__name__ == "Config":
        _found.pluginmanager.register(_Cheat(), "cheat")
        break
"""


def test_a_patch_rewriting_outcomes_in_process_scores_zero_even_without_the_guard(
    example: ExampleTask,
):
    """In-process code re-registers a report hook that turns every failure into a pass:
    the recorder saw the test call raise, so the records and the report disagree."""
    changes = {"calc/ops.py": ops_with(OUTCOME_REWRITER)}
    unguarded = score_change(example, changes, harness_guard=False)
    assert_zero(unguarded, "but the plugin recorded failed; treating as forged")
    result = score_change(example, changes)
    assert_zero(result, "patch reaches into the test harness: calc/ops.py:+3 'import pytest'")


ENCODED_REWRITER = base64.b64encode(OUTCOME_REWRITER.encode()).decode()
OBFUSCATED_REWRITER = f"import base64 as _b\nexec(_b.b64decode({ENCODED_REWRITER!r}).decode())\n"


def test_an_obfuscated_outcome_rewriter_passes_the_guard_and_still_scores_zero(
    example: ExampleTask,
):
    """The last known hole: the same hook, decoded at run time, is invisible to the static
    guard; the recorder's own view of the test call still catches it."""
    result = score_change(example, {"calc/ops.py": ops_with(OBFUSCATED_REWRITER)})
    assert_zero(result, "but the plugin recorded failed; treating as forged")


def test_a_patch_importing_pytest_internals_scores_zero_naming_the_line(example: ExampleTask):
    result = score_change(example, {"calc/ops.py": ops_with("import _pytest", "return a + b")})
    assert_zero(result, "patch reaches into the test harness: calc/ops.py:+1 'import _pytest'")


def test_the_signed_records_of_a_run_cannot_be_edited_reordered_or_cut_short():
    key = b"k" * 32
    recorder_lines = []
    for seq, body in enumerate(
        (
            {"kind": COLLECTED, "count": 1},
            {"kind": TEST, "nodeid": "t::a", "outcome": "failed"},
            {"kind": FINAL, "exitstatus": 1, "ran": 1},
        ),
        start=1,
    ):
        text = json.dumps({"seq": seq, **body}, sort_keys=True)
        recorder_lines.append(f"{RECORD_PREFIX} {sign(key, text)} {text}")
    honest = read_records("\n".join(recorder_lines).encode(), key)
    assert (honest.outcomes, honest.collected, honest.ran, honest.exitstatus) == (
        {"t::a": "failed"},
        1,
        1,
        1,
    )
    assert not honest.forged
    edited = "\n".join(recorder_lines).replace('"failed"', '"passed"').encode()
    assert "not signed" in read_records(edited, key).forged
    swapped = "\n".join([recorder_lines[1], recorder_lines[0], recorder_lines[2]]).encode()
    assert "out of sequence" in read_records(swapped, key).forged
    cut = read_records("\n".join(recorder_lines[:2]).encode(), key)
    assert cut.exitstatus is None and not cut.forged
    assert "not signed" in read_records("\n".join(recorder_lines).encode(), b"x" * 32).forged


def test_a_solution_in_git_history_is_out_of_reach(example: ExampleTask):
    (example.repo / "calc" / "ops.py").write_text(OPS_FIXED)
    git(example.repo, "commit", "-q", "-am", "the fix")
    git(example.repo, "tag", "solution")
    git(example.repo, "update-ref", "refs/hidden/answer", "HEAD")
    git(example.repo, "checkout", "-q", example.base_commit)
    leak = subprocess.run(
        ["git", "show", "solution:calc/ops.py"], cwd=example.repo, capture_output=True, text=True
    )
    assert "return a + b" in leak.stdout  # the answer is really in the task's repository
    thief = (
        "import subprocess\n"
        f"    for repo in ('.', {str(example.repo)!r}):\n"
        "        for ref in ('solution', 'refs/hidden/answer', '--all'):\n"
        "            done = subprocess.run(['git', '-C', repo, 'log', '-p', ref],\n"
        "                                  capture_output=True, text=True)\n"
        "            if '+    return a + b' in done.stdout:\n"
        "                return a + b\n"
        "    return a - b"
    )
    result = score_change(example, {"calc/ops.py": ops_with("", thief)})
    assert_zero(result, "test_add (failed)")


def test_a_missing_interpreter_is_an_infrastructure_error(example: ExampleTask):
    task = example.task().model_copy(update={"python": "/nonexistent/python3"})
    result = score(task, example.gold_patch)
    assert result.status is ScoreStatus.INFRA_ERROR and result.reward is None
    assert "/nonexistent/python3" in result.reason


def test_a_failing_setup_command_is_an_infrastructure_error(example: ExampleTask):
    task = example.task().model_copy(update={"setup_command": ["sh", "-c", "exit 7"]})
    result = score(task, example.gold_patch)
    assert result.status is ScoreStatus.INFRA_ERROR and result.reward is None
    assert "setup command failed (exit code 7" in result.reason


def test_a_missing_base_commit_is_an_infrastructure_error(example: ExampleTask):
    task = example.task().model_copy(update={"base_commit": "0" * 40})
    result = score(task, example.gold_patch)
    assert result.status is ScoreStatus.INFRA_ERROR and result.reward is None
    assert "base commit" in result.reason


def test_a_test_patch_that_does_not_apply_is_an_infrastructure_error(example: ExampleTask):
    task = example.task()
    broken = task.test_patch.replace("def test_sub", "def test_zzz", 1)
    result = score(task.model_copy(update={"test_patch": broken}), example.gold_patch)
    assert result.status is ScoreStatus.INFRA_ERROR and result.reward is None
    assert "test patch" in result.reason


def test_a_task_without_required_tests_is_rejected(tmp_path: Path):
    example = make_example_task(tmp_path, fail_to_pass=[], pass_to_pass=[])
    with pytest.raises(InvalidTask, match="no required tests"):
        example.task()


def test_a_malformed_task_file_is_rejected_with_its_cause(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidTask, match="not valid JSON"):
        load_task(bad)
    bad.write_text(
        json.dumps(
            {"id": "x", "repo": "r", "base_commit": "abcd", "fail_to_pass": ["t"], "surprise": 1}
        )
    )
    with pytest.raises(InvalidTask, match="surprise"):
        load_task(bad)


def test_scoring_uses_the_chosen_interpreter(example: ExampleTask):
    result = score(example.task(), example.gold_patch, python=sys.executable)
    assert result.reward == 1


def _base_with_test_patch_committed(example: ExampleTask):
    """The task with its test patch already in the base commit, and no test patch."""
    (example.repo.parent / "test.diff").write_text(example.task().test_patch)
    git(example.repo, "apply", str(example.repo.parent / "test.diff"))
    git(example.repo, "commit", "-q", "-am", "tests in the base")
    base = git(example.repo, "rev-parse", "HEAD").strip()
    return example.task().model_copy(update={"base_commit": base, "test_patch": ""})


def test_a_required_test_edited_through_other_diff_prefixes_scores_zero(example: ExampleTask):
    """`git apply` strips any first path component; the verdict follows git, not a/ b/."""
    task = _base_with_test_patch_committed(example)
    trivial = "def test_sub():\n    pass\n\n\ndef test_add():\n    pass\n"
    (example.repo / "tests" / "test_ops.py").write_text(trivial)
    patch = git(example.repo, "diff", "--src-prefix=x/", "--dst-prefix=y/")
    git(example.repo, "checkout", "-q", "--", ".")
    assert "x/tests/test_ops.py" in patch
    assert_zero(score(task, patch), "protected paths: tests/test_ops.py")


def test_pytest9_config_files_and_files_in_test_folders_are_protected(example: ExampleTask):
    for path in ("pytest.toml", ".pytest.toml", "tests/__init__.py", "tests/helpers/plug.py"):
        result = score_change(example, {path: "x = 1\n"})
        assert_zero(result, f"protected paths: {path}")


def test_a_protected_file_added_with_other_prefixes_is_named_as_git_reads_it(
    example: ExampleTask,
):
    patch = diff_of(example.repo, {"pytest.toml": "[pytest]\n"})
    patch = patch.replace(" a/", " x/").replace(" b/", " y/")
    assert "y/pytest.toml" in patch
    assert_zero(score(example.task(), patch), "protected paths: pytest.toml")


NEUTER_ASSERT_EQUAL = (
    "import unittest\n\nunittest.TestCase.assertEqual = lambda self, *a, **k: None\n"
)


def test_a_tests_package_init_that_disables_assertions_is_caught_by_the_canaries(
    example: ExampleTask,
):
    """tests/__init__.py runs at collection; the canaries beside the tests feel it."""
    (example.repo / "tests" / "__init__.py").write_text(NEUTER_ASSERT_EQUAL)
    git(example.repo, "commit", "-q", "-am", "neuter assertEqual")
    base = git(example.repo, "rev-parse", "HEAD").strip()
    result = score(example.task().model_copy(update={"base_commit": base}), example.gold_patch)
    assert result.status is ScoreStatus.TAMPERED and result.reward == 0, result.reason
    assert "canary" in result.reason and "must have failed, got passed" in result.reason


def test_the_package_under_test_disabling_assertions_is_tampering(example: ExampleTask):
    fixed = (example.repo / "calc" / "ops.py").read_text().replace("return a - b", "return a + b")
    patch = diff_of(example.repo, {"calc/__init__.py": NEUTER_ASSERT_EQUAL, "calc/ops.py": fixed})
    # The static guard would already refuse this; the canaries must catch it on their own.
    task = example.task().model_copy(update={"harness_guard": False})
    result = score(task, patch)
    assert result.status is ScoreStatus.TAMPERED and result.reward == 0, result.reason


def test_canaries_do_not_count_as_required_tests(example: ExampleTask):
    result = score(example.task(), example.gold_patch)
    assert result.reward == 1, result.reason
    assert all("::Test" not in test_id or "TestSubMore" in test_id for test_id in result.tests)


def _base_whose_tests_import(example: ExampleTask, module: str):
    task = _base_with_test_patch_committed(example)
    tests = example.repo / "tests" / "test_ops.py"
    tests.write_text(tests.read_text() + f"\n\nimport {module}  # noqa\n")
    git(example.repo, "commit", "-q", "-am", f"tests need {module}")
    base = git(example.repo, "rev-parse", "HEAD").strip()
    return task.model_copy(update={"base_commit": base})


def test_a_missing_third_party_test_dependency_is_an_infra_error_naming_it(
    example: ExampleTask,
):
    task = _base_whose_tests_import(example, "tether_absent_dependency")
    result = score(task, example.gold_patch)
    assert result.status is ScoreStatus.INFRA_ERROR and result.reward is None, result.reason
    assert "'tether_absent_dependency' is not installed" in result.reason


def test_a_patch_importing_a_missing_module_itself_still_scores_zero(example: ExampleTask):
    broken = "import tether_absent_dependency  # noqa\n" + OPS_FIXED
    assert_zero(score_change(example, {"calc/ops.py": broken}), "ended abnormally")


def test_a_patch_deleting_a_module_of_the_repository_still_scores_zero(example: ExampleTask):
    deleting = "diff --git a/calc/ops.py b/calc/ops.py\ndeleted file mode 100644\n" + "".join(
        f"{line}\n" for line in ["--- a/calc/ops.py", "+++ /dev/null"]
    )
    lines = OPS_BUGGY.splitlines()
    deleting += f"@@ -1,{len(lines)} +0,0 @@\n" + "".join(f"-{line}\n" for line in lines)
    result = score(example.task(), deleting)
    assert result.status is ScoreStatus.FAIL and result.reward == 0, result.reason


@pytest.fixture
def traversable_dir():
    """A folder the sandbox's uid can reach (pytest's tmp_path is private to root), inside
    this interpreter's prefix: a venv made there that reads our site-packages through a
    .pth stays able to, wherever the checkout lies (the sandbox's private /tmp binds back
    an interpreter's top folder under /tmp, so a clone under /tmp keeps its .venv)."""
    with tempfile.TemporaryDirectory(dir=sys.prefix, prefix="tether-test-") as name:
        os.chmod(name, 0o755)
        yield Path(name)


def test_an_installed_copy_shadowing_the_source_under_test_is_refused(
    example: ExampleTask, traversable_dir: Path
):
    """src/ layout: the tests would import the interpreter's installed (fixed) copy."""
    git(example.repo, "mv", "calc", "src")
    git(example.repo, "commit", "-q", "-m", "src layout")
    (example.repo / "src" / "calc").mkdir()
    for name in ("__init__.py", "ops.py"):
        git(example.repo, "mv", f"src/{name}", f"src/calc/{name}")
    git(example.repo, "commit", "-q", "-m", "src/calc")
    base = git(example.repo, "rev-parse", "HEAD").strip()
    venv = traversable_dir / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    ours = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    (site / "ours.pth").write_text(f"{ours}\n")
    (site / "calc").mkdir()
    (site / "calc" / "__init__.py").write_text("")
    (site / "calc" / "ops.py").write_text(OPS_FIXED)
    task = example.task().model_copy(
        update={"base_commit": base, "python": str(venv / "bin/python")}
    )
    result = score(task, "")
    assert result.status is ScoreStatus.INFRA_ERROR and result.reward is None, result.reason
    assert "imported calc" in result.reason and "installed copy" in result.reason


FORCE_PASS_CONFTEST = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def test_runner_files_and_test_folders_are_restored_from_the_base_before_the_tests_run(
    example: ExampleTask,
):
    """Whatever changed them before the tests (here the setup command: the patch's own
    changes are refused), the tests run with the base's conftest.py and test folder."""
    (example.repo / "conftest.py").write_text("")
    git(example.repo, "add", "conftest.py")
    git(example.repo, "commit", "-q", "-m", "an empty conftest")
    base = git(example.repo, "rev-parse", "HEAD").strip()
    rewrite = (
        f"printf %s {shlex.quote(FORCE_PASS_CONFTEST)} > conftest.py && "
        "echo 'raise SystemExit(0)' > tests/__init__.py"
    )
    task = example.task().model_copy(
        update={"base_commit": base, "setup_command": ["sh", "-c", rewrite]}
    )
    assert_zero(score(task, example.wrong_patch), "test_add (failed)")
