"""The refit benchmark runs end to end on the tiny model and ends with its JSON figures."""

from __future__ import annotations

from pathlib import Path

from tests.bench.bench_json import bench_figures

TINY = ["--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "32", "--intermediate", "384"]  # fmt: skip


def test_refit_bench_prints_its_figures_as_the_last_json_line(tmp_path: Path) -> None:
    figures = bench_figures("bench.refit", *TINY, "--work-dir", str(tmp_path), timeout=400)
    for key in ("staging_s", "pause_s", "full_reload_pause_s", "pause_over_full_reload"):
        assert figures[key] > 0, key
    assert figures["requests_during_staging"] >= 0
    assert figures["pause_s"] < figures["full_reload_pause_s"]
    assert figures["engine"] == "reference"
    assert figures["logprobs_match_after_commit"] is True, figures["logprobs_max_gap"]
    # The agent's collections while it served, read from its own metrics.
    assert figures["agent_gc_settle"] is True
    assert 0 <= figures["agent_gc_pauses_over_20ms"] <= figures["agent_gc_pauses"]
    assert (figures["agent_gc_s"] > 0) == (figures["agent_gc_pauses"] > 0), figures
    # Its codecs warmed at boot, before it served.
    assert figures["agent_warm_codecs"] is True
    assert figures["agent_codecs_warm_s"] > 0
    assert figures["agent_conversion_warm_s"] == 0  # a bf16 engine converts nothing
    # Its event loop probed while it staged (a tiny model may stage between two probes).
    probes, p50, p99, most = (
        figures[f"agent_health_{key}_staging"] for key in ("probes", "p50_ms", "p99_ms", "max_ms")
    )
    assert (probes == 0) == (p99 is None), figures
    assert probes == 0 or 0 < p50 <= p99 <= most, figures
    # Each catch-up stage, per core (thread CPU time) and on the wall.
    stages = {"fetch_gb_s", "fold_verify_gb_s", "convert_fp8_gb_s", "convert_nvfp4_gb_s",
              "write_staged_gb_s"}  # fmt: skip
    for kind in ("stages_gb_s_per_core", "stages_gb_s_wall"):
        assert set(figures[kind]) == stages
        assert all(rate > 0 for rate in figures[kind].values()), figures[kind]


def test_refit_bench_at_fp8_shows_conversion_with_and_without_incremental(
    tmp_path: Path,
) -> None:
    figures = bench_figures(
        "bench.refit", *TINY, "--precision", "fp8", "--update-fraction", "0.01",
        "--work-dir", str(tmp_path), timeout=400,
    )  # fmt: skip
    assert figures["incremental_conversion"] == "incremental"
    assert figures["convert_positions_from_fold"] > 0  # the stager did not diff the versions
    assert figures["staged_identical"] is True
    assert figures["convert_incremental_s"] > 0 and figures["convert_full_s"] > 0
    # An FP8 engine's agent loaded its conversion kernels at boot.
    assert figures["agent_conversion_warm_s"] > 0
