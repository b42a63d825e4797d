"""Fixtures of the sandbox tests: a real example repository, and a clean process table."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from sandboxes.example import ExampleTask, make_example_task
from sandboxes.settings import SandboxSettings

# The vendored third-party projects are data for the scorer, not tests of ours.
collect_ignore = ["projects"]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _leftovers(before: set[int]) -> list[psutil.Process]:
    """Processes started since `before` was taken, and any process of a sandbox uid.

    Children that were already running (servers of session-scoped fixtures from other
    test areas) are not the sandbox test's doing.
    """
    settings = SandboxSettings()
    lease_uids = range(settings.uid_first, settings.uid_first + settings.uid_count)
    found = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    if os.geteuid() == 0:
        for proc in psutil.process_iter(["uids"]):
            uids = proc.info["uids"]
            if uids is not None and uids.real in lease_uids:
                found.append(proc)
    return [p for p in found if _alive(p)]


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie. A process may exit between any two looks at it (`status`
    then raises NoSuchProcess): gone is not alive."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _described(process: psutil.Process) -> tuple[int, list[str] | str]:
    try:
        return process.pid, process.cmdline()
    except psutil.Error as exc:
        return process.pid, type(exc).__name__


@pytest.fixture(autouse=True)
def process_table_stays_clean():
    """Every sandbox test must leave no process of ours or of a sandbox uid behind."""
    before = _children()
    yield
    deadline = time.monotonic() + 5
    left = _leftovers(before)
    while left and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.2)
        left = _leftovers(before)
    assert not left, f"processes left behind: {[_described(p) for p in left]}"


@pytest.fixture
def example(tmp_path: Path) -> ExampleTask:
    return make_example_task(tmp_path)
