"""Reports are parsed from the file the runner wrote; other formats plug in by name."""

from __future__ import annotations

import pytest

from sandboxes.errors import InvalidTask
from sandboxes.example import ExampleTask
from sandboxes.parsers import (
    JUnitXmlParser,
    ReportUnreadable,
    TestOutcome,
    TestReport,
    get_parser,
    register_parser,
)
from sandboxes.scoring import ScoreStatus, score

XUNIT1 = b"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="n0nce" tests="5">
<testcase classname="tests.test_m" name="test_ok" file="tests/test_m.py" line="1"/>
<testcase classname="tests.test_m.TestC" name="test_param[1-2]" file="tests/test_m.py"/>
<testcase classname="tests.test_m" name="test_bad" file="tests/test_m.py">
<failure message="x"/></testcase>
<testcase classname="tests.test_m" name="test_err" file="tests/test_m.py">
<error message="x"/></testcase>
<testcase classname="tests.test_m" name="test_xfail" file="tests/test_m.py">
<skipped type="pytest.xfail"/></testcase>
<testcase classname="tests.test_m" name="no_file"/>
</testsuite></testsuites>"""


def test_junit_records_map_to_pytest_node_ids_and_outcomes():
    report = JUnitXmlParser().parse(XUNIT1)
    assert report.suite_name == "n0nce"
    assert report.outcomes == {
        "tests/test_m.py::test_ok": TestOutcome.PASSED,
        "tests/test_m.py::TestC::test_param[1-2]": TestOutcome.PASSED,
        "tests/test_m.py::test_bad": TestOutcome.FAILED,
        "tests/test_m.py::test_err": TestOutcome.ERROR,
        "tests/test_m.py::test_xfail": TestOutcome.SKIPPED,
    }
    assert report.has_failures


@pytest.mark.parametrize(
    "data",
    [b"<testsuites><testsuite", b"<html/>", b'<!DOCTYPE x [<!ENTITY a "b">]><testsuites/>'],
)
def test_malformed_or_entity_laden_reports_are_unreadable(data: bytes):
    with pytest.raises(ReportUnreadable):
        JUnitXmlParser().parse(data)


def test_an_unknown_parser_name_is_a_task_error():
    with pytest.raises(InvalidTask, match="unknown report parser 'tap9'"):
        get_parser("tap9")


class LinesParser:
    """A plug-in: each line of the report is `<test id> <outcome>`, first line the suite."""

    name = "lines-for-test"

    def parse(self, data: bytes) -> TestReport:
        suite, *rows = data.decode().splitlines()
        return TestReport(
            outcomes={t: TestOutcome(o) for t, o in (row.split() for row in rows)},
            suite_name=suite,
        )


RUNNER = (
    "import sys, subprocess\n"
    "report, nonce = sys.argv[1], sys.argv[2]\n"
    "check = 'from calc.ops import add; assert add(2, 3) == 5'\n"
    "code = subprocess.run([sys.executable, '-c', check]).returncode\n"
    "outcome = 'passed' if code == 0 else 'failed'\n"
    "open(report, 'w').write(nonce + '\\ncheck::add ' + outcome + '\\n')\n"
    "sys.exit(1 if code else 0)\n"
)


def test_a_registered_parser_and_command_score_like_pytest(example: ExampleTask):
    register_parser(LinesParser())
    task = example.task().model_copy(
        update={
            "parser": "lines-for-test",
            "test_command": ["{python}", "-c", RUNNER, "{report}", "{nonce}"],
            "fail_to_pass": ["check::add"],
            "pass_to_pass": [],
        }
    )
    assert score(task, example.gold_patch).reward == 1
    wrong = score(task, example.wrong_patch)
    assert wrong.status is ScoreStatus.FAIL and wrong.tests == {"check::add": "failed"}
