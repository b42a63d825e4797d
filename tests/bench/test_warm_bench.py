"""The warm-up benchmark runs end to end and ends with its figures."""

from __future__ import annotations

from tests.bench.bench_json import bench_figures


def test_warm_bench_times_each_way_and_the_first_large_fold_in_fresh_processes() -> None:
    figures = bench_figures("bench.warm", "--runs", "1", timeout=600)
    assert figures["runs"] == 1 and figures["cold_cache"] is False
    assert figures["large_update_elements"] > 1 << 22  # past one block: filled as folded
    for way in ("decoders", "encoders", "none"):
        for key in ("first_fold_s", "next_fold_s", "process_cpu_s"):
            assert figures[f"{way}_{key}"] > 0, (way, key)
        assert f"{way}_first_fold_extra_s" in figures
    assert figures["decoders_warm_s"] > 0 and figures["encoders_warm_s"] > 0
    assert "none_warm_s" not in figures
    # A process's CPU includes its warm-up.
    assert figures["decoders_process_cpu_s"] > figures["decoders_warm_s"]
    assert figures["encoders_over_decoders"] > 0
