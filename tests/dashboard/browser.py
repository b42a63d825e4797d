"""A real headless Chromium for the dashboard tests, driven by Playwright's Python package.

Debian's `chromium` is used as installed (`make test` installs it when missing); Playwright
never downloads a browser. Without the binary the tests skip, unless
`TETHER_BROWSER_TESTS=required` (set by `make test`) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str:
    """The Chromium binary, or skip/fail as `TETHER_BROWSER_TESTS` says."""
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if found:
        return found
    message = "Debian's chromium is not installed: apt-get install chromium (make test does)"
    if os.environ.get("TETHER_BROWSER_TESTS") == "required":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def browser_page(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """One fresh page in a headless Chromium; closed on the way out."""
    executable = chromium_path()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, args=CHROMIUM_ARGS, headless=True
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


def screenshot(page: Any, folder: Path, name: str) -> Path:
    """Save the visible page as `folder/name`, and also under `$TETHER_SCREENSHOTS` when
    set (how docs/img/ is refreshed)."""
    out = folder / name
    page.screenshot(path=str(out))
    extra = os.environ.get("TETHER_SCREENSHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(extra) / name))
    assert out.stat().st_size > 1000, "an empty screenshot"
    return out
