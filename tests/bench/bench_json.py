"""Running a benchmark script as a user would, and reading the JSON line it ends with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def bench_figures(module: str, *args: str, timeout: float) -> dict[str, Any]:
    """`python -m <module> <args>` from the repository root; its last stdout line as JSON.
    A non-zero exit fails the test with the script's output."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures
