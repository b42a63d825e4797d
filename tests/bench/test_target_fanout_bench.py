"""The target fan-out benchmark runs at a small size and ends with its figures."""

from __future__ import annotations

from tests.bench.bench_json import bench_figures


def test_target_fanout_bench_answers_every_parked_poll_of_each_publication():
    figures = bench_figures("bench.target_fanout", "--engines", "20", "--rounds", "2", timeout=180)
    assert figures["engines"] == 20 and figures["rounds"] == 2
    assert figures["answered_all"] is True
    assert 0 < figures["median_p50_ms"] <= figures["median_p99_ms"] <= figures["median_last_ms"]
