"""The trusted pytest launcher and recorder that runs a task's tests inside the sandbox.

Run as a script (`python <scorer>/tether_pytest.py <pytest args>`), it reads its secrets
(a record key, the record file, the JUnit report path and the suite nonce) as one JSON
object from stdin before pytest or any task code is imported, closes stdin, and starts
pytest with a `Recorder` plugin. Nothing secret is on the command line, in the
environment or in a file. The recorder appends one HMAC-signed JSON line per finished
test, one with the collected count, and a final one at session end carrying pytest's exit
status; a run that dies before `pytest_sessionfinish` (for example via `os._exit`) has no
final record, which the scorer treats as forged.

A test's recorded outcome is not only what pytest's reports say: the recorder also wraps
the test call itself (`pytest_runtest_call`, outermost) and notes whether it raised. A
report that says "passed" for a call that raised, or for a test whose call never ran, is
recorded as "failed" / "error", so code that rewrites reports (a `pytest_runtest_makereport`
hook registered from inside the tests' process) makes the records and the JUnit report
disagree, which the scorer treats as forged.

This module runs under the task's interpreter with only the standard library and pytest:
it must never import anything of Tether, and never trust what the tests print.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
from dataclasses import dataclass, field

RECORD_PREFIX = "tether-record"
FINAL, TEST, COLLECTED = "final", "test", "collected"
LAUNCHER_NAME = "tether_pytest.py"


def sign(key: bytes, body: str) -> str:
    """The hex HMAC-SHA256 of one record body."""
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def _outcome_of(reports: list) -> str:
    """One word per test from its setup/call/teardown reports (xfail counts as skipped)."""
    for report in reports:
        if report.failed:
            return "error" if report.when != "call" else "failed"
    for report in reports:
        if report.skipped:
            return "skipped"
    return "passed"


def foreign_modules(repo: str) -> dict[str, str]:
    """Imported modules of the repository's own packages that were loaded from elsewhere.

    The repository's packages are the folders with an `__init__.py` at its root and under
    `src/`; a module of one of them whose file lies outside the repository is an installed
    copy shadowing the code under test.
    """
    root = os.path.realpath(repo)
    packages = set()
    for folder in (root, os.path.join(root, "src")):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        packages |= {n for n in names if os.path.isfile(os.path.join(folder, n, "__init__.py"))}
    foreign = {}
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if name.split(".", 1)[0] in packages and where:
            path = os.path.realpath(where)
            if os.path.commonpath([path, root]) != root:
                foreign[name] = path
    return foreign


class Recorder:
    """A pytest plugin writing signed records to a file descriptor it alone was given."""

    def __init__(self, key: bytes, fd: int) -> None:
        self._key, self._fd, self._seq = key, fd, 0
        self._phases: dict[str, list] = {}
        self._ran = 0
        self._calls: dict[str, bool] = {}  # nodeid -> whether the test call raised

    def observe_call(self, item):
        """Hookwrapper around the test call: whether it raised, seen before any report."""
        outcome = yield
        self._calls[item.nodeid] = outcome.excinfo is not None

    def _write(self, kind: str, **fields: object) -> None:
        self._seq += 1
        body = json.dumps({"seq": self._seq, "kind": kind, **fields}, sort_keys=True)
        line = f"{RECORD_PREFIX} {sign(self._key, body)} {body}\n"
        os.write(self._fd, line.encode())

    def pytest_collection_finish(self, session) -> None:
        self._write(COLLECTED, count=len(session.items), foreign=foreign_modules(os.getcwd()))

    def pytest_runtest_logreport(self, report) -> None:
        self._phases.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        outcome = _outcome_of(self._phases.pop(nodeid, []))
        if outcome == "passed":
            # A pass needs a call that ran and returned; reports alone can be rewritten.
            raised = self._calls.get(nodeid)
            outcome = "error" if raised is None else "failed" if raised else "passed"
        self._calls.pop(nodeid, None)
        self._ran += 1
        self._write(TEST, nodeid=nodeid, outcome=outcome)

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self._write(FINAL, exitstatus=int(exitstatus), ran=self._ran)
        os.close(self._fd)


@dataclass
class Records:
    """What the signed records say. `forged` names the first bad record; empty when none."""

    outcomes: dict[str, str] = field(default_factory=dict)
    collected: int | None = None
    foreign: dict[str, str] = field(default_factory=dict)
    ran: int | None = None
    exitstatus: int | None = None
    forged: str = ""


def read_records(data: bytes, key: bytes) -> Records:
    """Check and read a record file (scorer side): every line signed, in sequence, once."""
    records = Records()
    for number, line in enumerate(data.decode(errors="replace").splitlines(), start=1):
        prefix, _, rest = line.partition(" ")
        mac, _, body = rest.partition(" ")
        if prefix != RECORD_PREFIX or not hmac.compare_digest(mac, sign(key, body)):
            records.forged = f"line {number} is not signed with this run's key: {line[:80]!r}"
            return records
        fields = json.loads(body)
        if fields["seq"] != number or records.exitstatus is not None:
            records.forged = f"line {number} is out of sequence (seq {fields['seq']})"
            return records
        if fields["kind"] == TEST:
            records.outcomes[fields["nodeid"]] = fields["outcome"]
        elif fields["kind"] == COLLECTED:
            records.collected = fields["count"]
            records.foreign = fields.get("foreign", {})
        elif fields["kind"] == FINAL:
            records.exitstatus, records.ran = fields["exitstatus"], fields["ran"]
    return records


def _read_secrets() -> dict:
    raw = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return json.loads(raw)


def main(argv: list[str]) -> int:
    """Read the secrets from stdin, then run pytest with `argv` and the recorder."""
    secrets_ = _read_secrets()
    key = bytes.fromhex(secrets_["key"])
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
    fd = os.open(secrets_["records"], flags, 0o600)
    import pytest  # only now: its import must not see the secrets on stdin

    sys.path[0] = os.getcwd()  # what `python -m pytest` puts first, in place of our folder
    args = [
        *argv,
        f"--junitxml={secrets_['junitxml']}",
        "-o",
        f"junit_suite_name={secrets_['nonce']}",
    ]
    del secrets_
    # Outermost wrapper of the test call: it sees the call's exception before any other
    # wrapper or report hook can hide it.
    hook = pytest.hookimpl(hookwrapper=True, tryfirst=True)(Recorder.observe_call)
    Recorder.pytest_runtest_call = hook  # type: ignore[attr-defined]
    return int(pytest.main(args, plugins=[Recorder(key, fd)]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
