"""The HTTP cost benchmark runs end to end with a few requests and ends with its figures."""

from __future__ import annotations

from tests.bench.bench_json import bench_figures


def test_http_cost_bench_prints_the_cpu_of_each_way_of_calling():
    figures = bench_figures("bench.http_cost", "--requests", "20", timeout=120)
    for key in (
        "httpx_keepalive_ms",
        "httpx_new_connection_ms",
        "httpx_absolute_url_ms",
        "raw_stream_ms",
    ):
        assert figures[key] > 0, key
