"""Coding-agent rewards: apply a policy's patch to a task and run its required tests, isolated.

Order, each step inside the sandbox unless noted: (host) reject patches touching protected
paths or whose added source lines reach into the test harness (`harness_guard`) → build the
fresh base snapshot → upload → check the interpreter runs pytest → setup command → strict
`git apply` of the policy patch → reject it if git's view of the changed tree reaches a
protected path (`git status`, `git apply --numstat`: however its diff spells paths; only
the pytest sections of `pyproject.toml`/`setup.cfg`) → restore from the base every runner
file (conftest, pytest/tox configuration, start-up hooks, bytecode) and the task's test
folders and test files, removing what is untracked in the latter → apply the test patch
→ run the tests through our launcher (`sandboxes.pytest_plugin`), its secrets given on
stdin → parse the JUnit report, check its nonce, the runner's exit status and the
launcher's signed records against each other, require every required test PASSED.

Reward 1 only then. Policy outcomes (patch does not apply, protected path, failures,
timeout, output cap, missing or forged report) give 0. Failures of the environment (no
isolation, interpreter cannot run pytest, setup or test patch fails, bad task) give status
`infra_error` and no reward, never 0: training on them would punish the policy for our faults.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from sandboxes import pytest_plugin
from sandboxes.base import ExecResult, Sandbox, SandboxSpec
from sandboxes.canaries import Canaries, make_canaries
from sandboxes.errors import InvalidTask, SandboxError
from sandboxes.harness_guard import harness_reaches
from sandboxes.parsers import ReportParser, ReportUnreadable, TestOutcome, TestReport, get_parser
from sandboxes.protection import (
    numstat_paths,
    patch_paths,
    protected_test_files,
    protected_violations,
    runner_pathspecs,
    runner_sections,
    section_protected,
    status_paths,
    task_test_folders,
)
from sandboxes.pytest_plugin import LAUNCHER_NAME, Records, read_records
from sandboxes.snapshot import build_snapshot
from sandboxes.task import Task

log = logging.getLogger(__name__)

SandboxFactory = Callable[[SandboxSpec], Sandbox]
SCORER_DIR = "scorer"
REPORT_DIR = "report"
PYTEST_EXIT_OK, PYTEST_EXIT_TESTS_FAILED = 0, 1


class ScoreStatus(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    TAMPERED = "tampered"  # reward 0: the scorer's canary tests did not end as they must
    INFRA_ERROR = "infra_error"


@dataclass
class ScoreResult:
    """The verdict. `reward` is None exactly when `status` is INFRA_ERROR."""

    task_id: str
    status: ScoreStatus
    reward: int | None
    reason: str
    tests: dict[str, str] = field(default_factory=dict)
    output_tail: str = ""
    isolation: str = ""
    duration_s: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "task_id": self.task_id,
            "status": self.status.value,
            "reward": self.reward,
            "reason": self.reason,
            "tests": self.tests,
            "isolation": self.isolation,
            "duration_s": round(self.duration_s, 3),
            "output_tail": self.output_tail,
        }


class _Verdict(Exception):
    """Internal: stops scoring early with a result."""

    def __init__(self, status: ScoreStatus, reason: str, run: ExecResult | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.run = status, reason, run


def _fail(reason: str, run: ExecResult | None = None) -> _Verdict:
    return _Verdict(ScoreStatus.FAIL, reason, run)


def _infra(reason: str, run: ExecResult | None = None) -> _Verdict:
    return _Verdict(ScoreStatus.INFRA_ERROR, reason, run)


def default_sandbox_factory(spec: SandboxSpec) -> Sandbox:
    from sandboxes.local import LocalSandbox

    return LocalSandbox(spec)


def score(
    task: Task,
    patch: str,
    *,
    sandbox_factory: SandboxFactory | None = None,
    python: str | None = None,
) -> ScoreResult:
    """Score one policy patch against one task; see the module docstring for the rules."""
    started = time.monotonic()
    factory = sandbox_factory or default_sandbox_factory
    result = ScoreResult(task.id, ScoreStatus.INFRA_ERROR, None, "")
    try:
        _score_into(result, task, patch, factory, python)
    except _Verdict as verdict:
        result.status, result.reason = verdict.status, verdict.reason
        result.reward = None if verdict.status is ScoreStatus.INFRA_ERROR else 0
        if verdict.run is not None:
            result.output_tail = _tail(verdict.run)
    except (SandboxError, OSError) as error:
        result.status, result.reward = ScoreStatus.INFRA_ERROR, None
        result.reason = f"{type(error).__name__}: {error}"
    result.duration_s = time.monotonic() - started
    log.info(
        "task %s scored %s (%s): %s", task.id, result.status.value, result.reward, result.reason
    )
    return result


def _score_into(
    result: ScoreResult, task: Task, patch: str, factory: SandboxFactory, python: str | None
) -> None:
    parser = get_parser(task.parser)
    touched = patch_paths(patch)
    if patch.strip() and not touched:
        raise _fail("the patch names no files; it is not a unified diff")
    violations = protected_violations(task, touched)
    if violations:
        raise _fail(f"the patch touches protected paths: {', '.join(violations)}")
    reaches = harness_reaches(patch) if task.harness_guard else []
    if reaches:
        shown = "; ".join(reach.describe() for reach in reaches[:3])
        more = f" (and {len(reaches) - 3} more)" if len(reaches) > 3 else ""
        raise _fail(f"patch reaches into the test harness: {shown}{more}")
    with tempfile.TemporaryDirectory(prefix="tether-snapshot-") as scratch:
        snapshot = Path(scratch) / "repo"
        try:
            build_snapshot(task.repo, task.base_commit, snapshot)
        except InvalidTask as error:
            raise _infra(str(error)) from None
        spec = SandboxSpec(
            memory_mib=task.memory_mib,
            timeout_s=task.timeout_s,
            network=False,
            python=python or task.python or SandboxSpec().python,
            extra_dirs=(SCORER_DIR, REPORT_DIR),
            hidden_paths=(str(task.repo),),
        )
        with factory(spec) as sandbox:
            result.isolation = sandbox.isolation
            sandbox.upload_tree(snapshot)
            local = _local_module_names(snapshot)
            try:
                _run_in(sandbox, spec, result, task, patch, parser)
            except _Verdict as verdict:
                output = _tail(verdict.run, 1 << 20) if verdict.run else ""
                missing = _missing_third_party(output, local, patch)
                if verdict.status is ScoreStatus.FAIL and missing:
                    raise _infra(
                        f"collecting the tests failed because module {missing!r} is not "
                        f"installed for {spec.python}; install it (or name it in the task's "
                        "setup), it is not the patch's fault",
                        verdict.run,
                    ) from None
                raise


_MISSING_MODULE = re.compile(r"No module named '([A-Za-z_][\w.]*)'")


def _local_module_names(repo: Path) -> set[str]:
    """Top-level names the repository itself provides (at its root and under src/)."""
    names = set()
    for folder in (repo, repo / "src"):
        if folder.is_dir():
            for entry in folder.iterdir():
                names.add(entry.stem if entry.suffix == ".py" else entry.name)
    return names


def _missing_third_party(output: str, local: set[str], patch: str) -> str:
    """The module a collection error says is missing, when neither repo nor patch owns it.

    A module of the repository (a file the patch deleted or broke), or one the patch's own
    added lines name, is the patch's doing and stays a 0.
    """
    if "ERROR collecting" not in output:
        return ""
    added = "\n".join(line for line in patch.splitlines() if line.startswith("+"))
    for match in _MISSING_MODULE.finditer(output):
        module = match.group(1)
        top = module.split(".", 1)[0]
        if top not in local and top not in added:
            return module
    return ""


def _run_in(
    sandbox: Sandbox,
    spec: SandboxSpec,
    result: ScoreResult,
    task: Task,
    patch: str,
    parser: ReportParser,
) -> None:
    python = spec.python
    probe = sandbox.exec([python, "-c", "import pytest"], timeout_s=120)
    if not probe.ok:
        raise _infra(f"interpreter {python} cannot import pytest in the sandbox", probe)
    if task.setup_command:
        setup = sandbox.exec(task.setup_command, timeout_s=task.setup_timeout_s)
        if not setup.ok:
            raise _infra(f"the task's setup command failed ({setup.describe()})", setup)
    scorer = sandbox.dir(SCORER_DIR)
    if patch.strip():
        sandbox.write_file(f"{scorer}/policy.diff", patch.encode())
        before = _tree_status(sandbox)
        applied = _git_apply(sandbox, f"{scorer}/policy.diff")
        if not applied.ok:
            raise _fail(f"the patch does not apply with git apply ({applied.describe()})", applied)
        _refuse_protected_effect(sandbox, task, before, f"{scorer}/policy.diff")
    _restore_protected(sandbox, task)
    if task.test_patch.strip():
        sandbox.write_file(f"{scorer}/test.diff", task.test_patch.encode())
        applied = _git_apply(sandbox, f"{scorer}/test.diff")
        if not applied.ok:
            raise _infra(f"the task's test patch does not apply ({applied.describe()})", applied)
    tests = _run_tests(sandbox, task, python)
    run = tests.run
    result.output_tail = _tail(run)
    if run.timed_out:
        raise _fail(f"the tests did not finish within {task.timeout_s:g} s", run)
    if run.output_limited:
        raise _fail("the tests printed more than the output cap and were killed", run)
    try:
        report = parser.parse(sandbox.read_file(tests.report_path))
    except FileNotFoundError:
        raise _fail(f"the test run wrote no report ({run.describe()})", run) from None
    except ReportUnreadable as error:
        raise _fail(f"the test report is unreadable: {error}", run) from None
    _judge_report(report, run, tests.nonce)
    if tests.records_path:
        records = read_records(_read_optional(sandbox, tests.records_path), tests.key)
        if records.forged:
            raise _fail(f"the plugin's records were tampered with: {records.forged}", run)
        if records.foreign:
            name, path = sorted(records.foreign.items())[0]
            raise _infra(
                f"the tests imported {name} from {path}, an installed copy, not from the "
                f"repository: uninstall the project from {python} "
                "(the code under test must be the patched source)",
                run,
            )
        _cross_check(task, report, run, records)
        if tests.canaries is not None:
            _check_canaries(tests.canaries, report, records, run)
    _award(result, task, report, run)


@dataclass(frozen=True)
class _TestRun:
    """One run of the tests and what it was told in secret, to check its outputs against."""

    run: ExecResult
    report_path: str
    nonce: str
    key: bytes = b""
    records_path: str = ""
    canaries: Canaries | None = None


def _run_tests(sandbox: Sandbox, task: Task, python: str) -> _TestRun:
    nonce = secrets.token_hex(16)
    report_dir = sandbox.dir(REPORT_DIR)
    report_path = f"{report_dir}/{secrets.token_hex(16)}.xml"
    # No entry-point plugins: faster, and nothing installed can rewrite reports behind us.
    # A task that needs a plugin names it in test_args (`-p pytest_timeout`).
    env = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if task.test_command:
        fill = {"{python}": python, "{report}": report_path, "{nonce}": nonce}
        argv = [fill.get(arg, arg) for arg in task.test_command]
        return _TestRun(sandbox.exec(argv, env=env, timeout_s=task.timeout_s), report_path, nonce)
    # Our launcher reads the secrets from stdin before any task code runs: nothing of them
    # is on the command line, in the environment or in a file the tests could read.
    key = secrets.token_bytes(32)
    records_path = f"{report_dir}/{secrets.token_hex(16)}.records"
    launcher = f"{sandbox.dir(SCORER_DIR)}/{LAUNCHER_NAME}"
    sandbox.write_file(launcher, Path(pytest_plugin.__file__).read_bytes())
    # Written only now, after every patch: nothing the policy wrote can know its names.
    canaries = make_canaries(task.required[0].split("::", 1)[0])
    sandbox.write_file(f"{sandbox.workdir}/{canaries.path}", canaries.source.encode())
    told = {"key": key.hex(), "records": records_path, "junitxml": report_path, "nonce": nonce}
    run = sandbox.exec(
        [python, launcher, *PYTEST_ARGS, *task.test_args, canaries.path],
        env=env,
        timeout_s=task.timeout_s,
        stdin=json.dumps(told).encode(),
    )
    return _TestRun(run, report_path, nonce, key, records_path, canaries)


def _read_optional(sandbox: Sandbox, path: str) -> bytes:
    try:
        return sandbox.read_file(path)
    except FileNotFoundError:
        return b""


def _git_apply(sandbox: Sandbox, diff_path: str) -> ExecResult:
    # Strict: no --3way, no --reject, no fuzzy `patch` fallback (which follows symlinks).
    # `git apply` checks every hunk before it writes anything: all or nothing.
    return sandbox.exec(["git", "apply", diff_path], timeout_s=120)


def _git_text(sandbox: Sandbox, argv: list[str]) -> str:
    done = sandbox.exec(["git", *argv], timeout_s=120)
    if not done.ok:
        raise _infra(f"git {argv[0]} failed in the sandbox ({done.describe()})", done)
    return done.stdout.decode("utf-8", "surrogateescape")


def _tree_status(sandbox: Sandbox) -> dict[str, str]:
    # Ignored files count too: a patch may create one pytest or Python would still load.
    return status_paths(
        _git_text(
            sandbox,
            ["status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignored=matching"],
        )
    )


def _refuse_protected_effect(
    sandbox: Sandbox, task: Task, before: dict[str, str], diff_path: str
) -> None:
    """Judge what the patch did to the tree as git sees it, not how its diff names paths."""
    after = _tree_status(sandbox)
    effect = {path for path, code in after.items() if before.get(path) != code}
    effect |= {path for path in before if path not in after}
    effect |= numstat_paths(_git_text(sandbox, ["apply", "--numstat", "-z", diff_path]))
    violations = protected_violations(task, effect)
    violations += [
        f"{path} (its pytest section)"
        for path in section_protected(effect)
        if _runner_sections_changed(sandbox, path)
    ]
    if violations:
        raise _fail(f"the patch touches protected paths: {', '.join(violations)}")


def _runner_sections_changed(sandbox: Sandbox, path: str) -> bool:
    """Whether the patch changed the pytest sections of a pyproject.toml or setup.cfg.

    Both sides are read inside the sandbox (the patched file may be a symlink).
    """
    name = path.rsplit("/", 1)[-1]
    base = sandbox.exec(["git", "show", f"HEAD:{path}"], timeout_s=60)
    now = sandbox.exec(["cat", "--", path], timeout_s=60)

    def text(run: ExecResult) -> str | None:
        return run.stdout.decode("utf-8", "replace") if run.ok else None

    return runner_sections(name, text(base)) != runner_sections(name, text(now))


# Restores from HEAD what `$@` names (runner files first, then the task's test folders and
# files), then cleans untracked files from the latter. Runner files are only restored, not
# cleaned: an untracked one is the setup command's, as the patch's were refused before.
_RESTORE_SCRIPT = """set -e
runner=$1; shift
git ls-files -z -- "$@" | xargs -0 -r git --literal-pathspecs checkout -q HEAD --
shift "$runner"
[ $# -eq 0 ] || git clean -fdq -- "$@"
"""


def _restore_protected(sandbox: Sandbox, task: Task) -> None:
    """Put back, as the base has them, every test folder and test file of the task and every
    file pytest or Python loads on its own, whatever the patch did; files the test patch
    creates are removed (it creates them again). One sandboxed command for all of it."""
    runner = runner_pathspecs()
    tests = sorted(task_test_folders(task) | protected_test_files(task))
    literal = [f":(literal){path}" for path in tests]
    done = sandbox.exec(
        ["sh", "-c", _RESTORE_SCRIPT, "sh", str(len(runner)), *runner, *literal], timeout_s=60
    )
    if not done.ok:
        raise _infra(f"could not restore the task's tests from the base: {done.describe()}", done)


PYTEST_ARGS = (
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:randomly",
    "-o",
    "junit_family=xunit1",
    "-o",
    "junit_logging=no",
    "--rootdir=.",
    "--confcutdir=.",
)


def _judge_report(report: TestReport, run: ExecResult, nonce: str) -> None:
    if report.suite_name != nonce:
        raise _fail(
            "the test report does not carry this run's nonce; it was not written by it", run
        )
    if run.exit_code not in (PYTEST_EXIT_OK, PYTEST_EXIT_TESTS_FAILED):
        raise _fail(f"the test runner ended abnormally ({run.describe()})", run)
    if (run.exit_code == PYTEST_EXIT_OK) == report.has_failures:
        raise _fail(
            f"the report and the runner's exit code {run.exit_code} disagree; treating as forged",
            run,
        )


def _cross_check(task: Task, report: TestReport, run: ExecResult, records: Records) -> None:
    """The plugin's signed records must exist, be complete, and agree with everything else."""
    if records.exitstatus is None:
        raise _fail(
            "the test process ended before pytest finished its session (no final record "
            f"from the scorer's plugin; {run.describe()}); treating as forged",
            run,
        )
    if records.exitstatus != run.exit_code:
        raise _fail(
            f"pytest's session ended with status {records.exitstatus} but the process exited "
            f"with {run.exit_code}; treating as forged",
            run,
        )
    if run.exit_code == PYTEST_EXIT_OK and records.ran != records.collected:
        raise _fail(
            f"pytest collected {records.collected} tests but ran {records.ran} and still "
            "exited 0; treating as forged",
            run,
        )
    for test_id in task.required:
        recorded, reported = records.outcomes.get(test_id), report.outcomes.get(test_id)
        if reported is not None and recorded != reported.value:
            raise _fail(
                f"the JUnit report says {test_id} {reported.value} but the plugin recorded "
                f"{recorded}; treating as forged",
                run,
            )


def _check_canaries(
    canaries: Canaries, report: TestReport, records: Records, run: ExecResult
) -> None:
    """Every canary must end as it must, in the signed records and in the JUnit report."""
    reported = {nodeid: outcome.value for nodeid, outcome in report.outcomes.items()}
    wrong = canaries.deviations(records.outcomes) or canaries.deviations(reported)
    if wrong:
        shown = "; ".join(wrong[:3]) + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else "")
        raise _Verdict(
            ScoreStatus.TAMPERED,
            "tampered: the scorer's canary tests did not end as they must, so something in "
            f"the run changes test outcomes: {shown}",
            run,
        )


def _award(result: ScoreResult, task: Task, report: TestReport, run: ExecResult) -> None:
    missing = object()
    for test_id in task.required:
        outcome = report.outcomes.get(test_id, missing)
        result.tests[test_id] = outcome.value if isinstance(outcome, TestOutcome) else "missing"
    not_passed = [t for t, o in result.tests.items() if o != TestOutcome.PASSED.value]
    if not_passed:
        shown = ", ".join(f"{t} ({result.tests[t]})" for t in not_passed[:5])
        raise _fail(f"{len(not_passed)} required test(s) did not pass: {shown}", run)
    result.status, result.reward = ScoreStatus.PASS, 1
    result.reason = f"all {len(task.required)} required tests passed"


def _tail(run: ExecResult, size: int = 2000) -> str:
    text = (run.stdout + b"\n" + run.stderr).decode(errors="replace").strip()
    return text[-size:]
