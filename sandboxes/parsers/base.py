"""The test-report parser plug-in interface and the outcome vocabulary every parser speaks.

A parser turns the bytes of a report file written by the test runner into a `TestReport`.
Parsers must never look at the runner's stdout: it is produced by the code under test and
is trivially forged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class TestOutcome(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"

    __test__ = False  # not a pytest test class


class ReportUnreadable(ValueError):
    """The report exists but is not a report this parser understands."""


@dataclass
class TestReport:
    """Outcome per test id, and the suite name the runner was told to write."""

    outcomes: dict[str, TestOutcome] = field(default_factory=dict)
    suite_name: str | None = None

    __test__ = False

    @property
    def has_failures(self) -> bool:
        bad = (TestOutcome.FAILED, TestOutcome.ERROR)
        return any(outcome in bad for outcome in self.outcomes.values())


class ReportParser(Protocol):
    """A plug-in: `name` is what a task's `parser` field refers to."""

    name: str

    def parse(self, data: bytes) -> TestReport: ...
