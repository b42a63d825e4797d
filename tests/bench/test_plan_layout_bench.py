"""The fetch-plan layout benchmark runs at a small size and ends with its figures."""

from __future__ import annotations

from tests.bench.bench_json import bench_figures


def test_plan_layout_bench_reports_balanced_trees_for_fleets_that_waited_and_that_arrive():
    figures = bench_figures(
        "bench.plan_layout", "--engines", "40", "--holders", "0", "--holders", "1",
        "--finish-after", "5", timeout=120,
    )  # fmt: skip
    assert len(figures["cases"]) == 8  # 1 size x 2 holder counts x 4 ways
    assert any(c["asks_within"] == 5 for c in figures["cases"])
    assert figures["waited"] == {
        "max_children": 2, "max_store_roots_per_lane": 1, "max_interior_in_two_lanes": 0
    }  # fmt: skip
    assert figures["arriving"]["max_children"] <= 3
    assert figures["arriving"]["max_store_roots_per_lane"] <= 2
    assert figures["arriving"]["max_interior_in_two_lanes"] == 0
