"""JUnit XML (as pytest writes it with `junit_family=xunit1`) to outcomes keyed by node id.

pytest's xunit1 records carry `file`, `classname` and `name`, from which the pytest node id
(`tests/test_calc.py::TestAdd::test_one[2]`) is rebuilt. Owns that mapping; it must never
trust an element it cannot map (such records are skipped, so a required test stays missing).
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from sandboxes.parsers.base import ReportUnreadable, TestOutcome, TestReport


def node_id(file: str, classname: str, name: str) -> str:
    """Rebuild a pytest node id from xunit1 attributes."""
    module = file[:-3] if file.endswith(".py") else file
    dotted = module.replace("/", ".")
    classes = classname[len(dotted) :].lstrip(".") if classname.startswith(dotted) else ""
    parts = [file, *[c for c in classes.split(".") if c], name]
    return "::".join(parts)


class JUnitXmlParser:
    name = "junit"

    def parse(self, data: bytes) -> TestReport:
        if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
            raise ReportUnreadable("JUnit report declares a DTD or entities; refusing it")
        try:
            root = ElementTree.fromstring(data)
        except ElementTree.ParseError as error:
            raise ReportUnreadable(f"JUnit report is not well-formed XML: {error}") from error
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        if root.tag not in ("testsuite", "testsuites") or not suites:
            raise ReportUnreadable(f"expected <testsuites>/<testsuite>, found <{root.tag}>")
        report = TestReport(suite_name=suites[0].get("name"))
        for suite in suites:
            for case in suite.iter("testcase"):
                file, name = case.get("file"), case.get("name")
                if not file or not name:
                    continue
                test_id = node_id(file, case.get("classname", ""), name)
                report.outcomes[test_id] = _outcome(case)
        return report


def _outcome(case: ElementTree.Element) -> TestOutcome:
    tags = {child.tag for child in case}
    if "error" in tags:
        return TestOutcome.ERROR
    if "failure" in tags:
        return TestOutcome.FAILED
    if "skipped" in tags:  # includes xfail: an expected failure is not a pass
        return TestOutcome.SKIPPED
    return TestOutcome.PASSED
