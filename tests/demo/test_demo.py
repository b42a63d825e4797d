"""`tether demo`: publishes versions end to end and ends with one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from cli import app
from store.store import Store
from store.types import VersionKind, VersionRef

ROOT = Path(__file__).resolve().parents[2]


def test_demo_publishes_verified_versions_with_anchors_and_prints_figures(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    result = CliRunner().invoke(
        app,
        ["demo", "--store", url, "--versions", "6", "--run", "demo-a", "--anchor-every", "4"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert figures["verified"] and figures["latest_bit_identical"]
    assert figures["kinds"] == ["full", "delta", "delta", "delta", "full", "delta"]
    assert figures["mean_delta_over_full"] < 0.5
    store = Store(url)
    assert store.read_pointer("demo-a") == VersionRef("demo-a", 5)
    assert store.read_manifest(VersionRef("demo-a", 4)).kind is VersionKind.FULL
    assert "latest" in result.output  # the listing table


def test_demo_runs_as_a_command_and_rejects_a_bad_store(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "cli", "demo", "--store", str(tmp_path / "s"), "--versions", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.strip().splitlines()[-1])["versions"] == 2
    bad = subprocess.run(
        [sys.executable, "-m", "cli", "demo", "--store", "gs://nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and "not supported" in bad.stderr
