"""Registry of test-report parsers; `junit` is built in, others register by name."""

from __future__ import annotations

from sandboxes.errors import InvalidTask
from sandboxes.parsers.base import (
    ReportParser,
    ReportUnreadable,
    TestOutcome,
    TestReport,
)
from sandboxes.parsers.junit import JUnitXmlParser

_REGISTRY: dict[str, ReportParser] = {}


def register_parser(parser: ReportParser) -> None:
    """Make `parser` available to tasks whose `parser` field names it."""
    _REGISTRY[parser.name] = parser


def get_parser(name: str) -> ReportParser:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InvalidTask(
            f"unknown report parser {name!r}; known: {sorted(_REGISTRY)} "
            "(register one with sandboxes.parsers.register_parser)"
        ) from None


register_parser(JUnitXmlParser())

__all__ = [
    "JUnitXmlParser",
    "ReportParser",
    "ReportUnreadable",
    "TestOutcome",
    "TestReport",
    "get_parser",
    "register_parser",
]
