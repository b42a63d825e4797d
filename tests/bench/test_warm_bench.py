"""The warm-up benchmark runs end to end and ends with its figures."""

from __future__ import annotations

from tests.bench.bench_json import bench_figures


def test_warm_bench_times_both_ways_in_fresh_processes() -> None:
    figures = bench_figures("bench.warm", "--runs", "1", timeout=300)
    assert figures["runs"] == 1 and figures["cold_cache"] is False
    for key in ("decoders_s", "encoders_s", "decoders_process_cpu_s", "encoders_process_cpu_s"):
        assert figures[key] > 0, key
    # A process's CPU includes its warm-up.
    assert figures["decoders_process_cpu_s"] > figures["decoders_s"] / 2
    assert figures["encoders_over_decoders"] > 0
