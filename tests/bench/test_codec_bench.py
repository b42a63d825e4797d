"""The codec benchmark runs end to end at a tiny size and ends with its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_codec_bench_prints_its_figures_as_the_last_json_line():
    done = subprocess.run(
        [sys.executable, "-m", "bench.codec", "--params", "2e5", "--steps", "1", "--lrs", "1e-6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("sparse_over_xor", "sparse_over_entropy", "encode_gb_s", "decode_gb_s", "params"):
        assert figures[key] > 0, key
    assert figures["sparse_over_xor"] < 1.0
    assert len(figures["steps"]) == 1


def test_tether_bench_codec_has_help():
    done = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "codec", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--params" in done.stdout
