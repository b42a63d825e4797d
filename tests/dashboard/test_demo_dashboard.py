"""`tether demo` prints the dashboard's address, and the page shows the demo's fleet live."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.dashboard.browser import browser_page, chromium_path, screenshot
from tests.fixtures.processes import ROOT, TETHER

START_DEADLINE_S = 240
SHOW_MS = 120_000


@pytest.mark.slow
def test_the_demo_prints_its_dashboard_and_the_page_follows_its_fleet(tmp_path: Path) -> None:
    chromium_path()
    workdir = tmp_path / "demo"
    demo = subprocess.Popen(
        [TETHER, "demo", "--steps", "200", "--prompts", "2", "--group-size", "2",
         "--workdir", str(workdir), "--run", "watched"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    try:
        assert demo.stdout is not None
        address = None
        end = time.monotonic() + START_DEADLINE_S
        for line in demo.stdout:  # the address comes right after the control plane starts
            found = re.search(r"(http://127\.0\.0\.1:\d+/dashboard#token=\S+)", line)
            if found:
                address = found.group(1)
                break
            assert time.monotonic() < end, "the demo never printed its dashboard"
        assert address is not None, "the demo ended without printing its dashboard"
        with browser_page() as page:
            page.goto(address)
            page.wait_for_function(
                "() => document.querySelector('#shown')?.textContent === '(3 of 3)'",
                timeout=SHOW_MS,
            )
            precisions = page.locator("#engines tbody td:nth-child(2)").all_inner_texts()
            assert sorted(precisions) == ["bf16", "fp8", "nvfp4"]
            # Training moves the fleet: rows reach v2 and the trainer's gap shows up.
            page.wait_for_function(
                "() => [...document.querySelectorAll('#engines td.served')]"
                ".every(td => Number(td.textContent.slice(1)) >= 2)",
                timeout=SHOW_MS,
            )
            page.wait_for_selector("#gap-table tbody tr", timeout=SHOW_MS)
            assert page.locator("#timeline tbody tr[data-version]").count() >= 3
            # A few more steps, so the screenshot shows a timeline and a gap curve.
            page.wait_for_function(
                "() => document.querySelectorAll('#timeline tr[data-version]').length >= 6"
                " && document.querySelectorAll('#gap svg polyline').length === 3",
                timeout=SHOW_MS,
            )
            screenshot(page, tmp_path, "dashboard-demo.png")
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.communicate(timeout=60)
        finally:
            if demo.poll() is None:
                demo.kill()
