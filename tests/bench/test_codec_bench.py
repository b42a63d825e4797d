"""The codec benchmark runs end to end at a tiny size and ends with its JSON figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.bench.bench_json import bench_figures

ROOT = Path(__file__).resolve().parents[2]


def test_codec_bench_prints_its_figures_as_the_last_json_line():
    """A uniform and an update-rule density case and one real-gradient step (with its FP8
    and NVFP4 views), tiny."""
    figures = bench_figures(
        "bench.codec", "--params", "2e5", "--densities", "0.01", "--warmup-steps", "1",
        "--rl-lrs", "1e-6", "--rl-steps", "1", "--repeats", "1", timeout=600,
    )  # fmt: skip
    for key in (
        "worst_sparse_over_xor",
        "worst_sparse_over_entropy",
        "min_encode_gb_s",
        "min_decode_gb_s",
        "two_core_speedup",
        "convert_fp8_gb_s",
        "convert_nvfp4_gb_s",
        "params",
        "uniform_worst_sparse_over_xor",
    ):
        assert figures[key] > 0, key
    assert figures["worst_sparse_over_xor"] < 1.0
    kinds = [case["kind"] for case in figures["cases"]]
    assert kinds == ["density", "update", "real-bf16", "real-fp8", "real-nvfp4"]
    # The xor target is over the update-rule and real cases; the uniform one is apart.
    assert figures["worst_sparse_over_xor_cases"] == ["update 1%", "bf16 lr1e-06 s1"]
    assert 0 < figures["uniform_worst_sparse_over_xor"] < 1.0
    assert set(figures["stages_gb_s_per_core"]) == {
        "fetch_gb_s",
        "fold_verify_gb_s",
        "convert_fp8_gb_s",
        "convert_nvfp4_gb_s",
        "write_staged_gb_s",
    }
    assert set(figures["stages_gb_s_wall"]) == set(figures["stages_gb_s_per_core"])


def test_only_two_core_measures_the_speedup_alone():
    """`--only-two-core`: wall ratio, CPU concurrency and efficiency, and the two-process
    ceiling they are read against, best and median."""
    figures = bench_figures(
        "bench.codec", "--params", "2e5", "--only-two-core", "--pairs", "2", timeout=300
    )
    assert figures["pairs"] == 2 and figures["speedup_density"] == 0.01
    for job in ("encode", "decode"):
        for key in (
            f"two_core_speedup_{job}",
            f"two_core_speedup_{job}_median",
            f"two_thread_cpu_concurrency_{job}",
            f"two_thread_cpu_concurrency_{job}_median",
            f"two_thread_cpu_efficiency_{job}",
            f"two_thread_cpu_efficiency_{job}_best",
            f"two_process_ceiling_{job}",
            f"two_process_ceiling_{job}_median",
            f"two_core_of_ceiling_{job}",
        ):
            assert figures[key] > 0, key
        # The best of the pairs is at least their median.
        assert figures[f"two_process_ceiling_{job}"] >= figures[f"two_process_ceiling_{job}_median"]
    assert "cases" not in figures  # nothing else was measured


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
