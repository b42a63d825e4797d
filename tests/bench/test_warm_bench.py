"""The warm-up benchmark runs end to end and ends with its figures."""

from __future__ import annotations

import subprocess
import sys

from tests.bench.bench_json import ROOT, bench_figures

WAYS = ("agent", "decoders", "encoders", "none")


def test_warm_bench_times_each_way_s_first_fold_and_conversion_in_fresh_processes() -> None:
    figures = bench_figures("bench.warm", "--runs", "1", "--precision", "fp8", timeout=600)
    assert figures["runs"] == 1 and figures["cold_cache"] is False
    assert figures["precision"] == "fp8"
    assert figures["large_update_elements"] > 1 << 22  # past one block: filled as folded
    for way in WAYS:
        for key in ("first_fold_s", "next_fold_s", "first_convert_s", "next_convert_s"):
            assert figures[f"{way}_{key}"] > 0, (way, key)
        for job in ("fold", "convert"):
            assert f"{way}_first_{job}_extra_s" in figures
        assert figures[f"{way}_process_cpu_s"] > 0
    assert "none_warm_s" not in figures
    # The agent's way does the decoders' warm-up and then the conversion's.
    assert figures["agent_warm_s"] > 0 and figures["decoders_warm_s"] > 0
    assert figures["encoders_over_decoders"] > 0


def test_warm_bench_refuses_a_precision_it_cannot_convert_to() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.warm", "--precision", "bf16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--precision" in done.stderr and "fp8 or nvfp4" in done.stderr
