"""`tether bench fleet` at a tiny scale: real agents, real PostgreSQL, real S3, capped links.

The figures are the benchmark's business; these tests check that the swarm runs the whole
agent path in several worker processes (every engine commits every version, over
heartbeats and long-polls, with peer fetch on and one agent serving its peers damaged
files), that the control plane's own latency histograms are read, that the caps hold (no
engine gets a version faster than its link carries it; the store's link is one queue across
processes), that every engine staged the same weights, and that the scaling models recover
the curves they are fitted to.
"""

from __future__ import annotations

import math
import multiprocessing
import os

import pytest

from bench.capped_link import Egress, Link, SharedLink
from bench.cp_latency import above, quantile, window
from bench.fleet import (
    CONVERGE_DEADLINE_S,
    FleetConfig,
    converge_deadline,
    fit,
    fraction_time,
    measure,
    models,
)
from bench.swarm import MB
from launcher.postgres import find_pg_bin
from launcher.seaweed import find_weed

ENGINES = 4


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.s3
@pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL binaries are not installed")
@pytest.mark.skipif(find_weed() is None, reason="the SeaweedFS 'weed' binary is not installed")
def test_every_engine_of_the_swarm_commits_the_store_s_bytes_despite_a_lying_peer() -> None:
    everywhere = os.sched_getaffinity(0)
    # With two CPUs or more, the control plane and its PostgreSQL get one of their own.
    alone = frozenset({min(everywhere)}) if len(everywhere) > 1 else frozenset()
    config = FleetConfig(
        engines=ENGINES, versions=2, model_kb=128, agent_link_mbps=0.5, store_egress_mbps=5.0,
        heartbeat_s=0.5, lease_s=10.0, threads=8, procs=2, peers=True, bad_peers=1,
        controlplane_cpus=alone, first_catchup_speedup=50.0,
    )  # fmt: skip
    result = measure(config, say=lambda _line: None)

    assert os.sched_getaffinity(0) == everywhere  # the bench's own CPUs are given back
    assert result["controlplane_cpus"] == sorted(alone)
    assert result["cp_gc_pauses"] is not None
    assert result["engines"] == ENGINES
    assert result["swarm_procs"] == 2
    rows = result["per_version"]
    # v1 and v2 went to the lone first engine (the single-engine catch-up, warm).
    assert [r["version"] for r in rows] == [3, 4]
    for row in rows:
        assert row["t100_s"] is not None
        # Nobody gets the version faster than their own link carries it (the links ran
        # faster for the fleet's first catch-up only).
        assert row["t50_s"] >= row["version_bytes"] / (config.agent_link_mbps * MB)
        # The store served the version at least once, whoever passed it on.
        assert row["store_egress_bytes"] >= row["version_bytes"]
        assert row["store_shards_bytes"] >= row["shard_bytes"] > 0
        # The control plane read the version's claim and index (for the plans naming
        # peers), and those reads count in the store's egress.
        assert row["store_controlplane_bytes"] > 0
        assert row["woken"] >= 1
    assert result["heartbeats"] > 0
    assert result["heartbeat_p99_ms"] is not None
    # The control plane's own side of the same latencies, from its histograms.
    assert result["cp_heartbeats"] > 0
    assert result["cp_heartbeat_p99_ms"] is not None
    assert result["cp_wakes"] >= 1
    # Heartbeats that changed an engine's state reached the fleet snapshot: patched in, or
    # with a read of the changed rows that was due anyway (a publication, a registration,
    # the periodic refresh). Which of the two takes a given beat depends on timing (on a
    # busy machine every one may meet a due read), so only their sum is certain; the
    # publications (and the periodic refresh) made it read every row back.
    assert result["cp_snapshot_patches"] >= 0
    assert result["cp_snapshot_patches"] + result["cp_snapshot_changed_reads"] > 0
    assert result["cp_snapshot_reads"] > 0
    assert result["swarm_loop_lag_p99_ms"] is not None
    # The swarm processes settled their collectors and timed every collection after.
    assert result["swarm_gc_settled"] is True
    assert (result["swarm_gc_pause_max_ms"] is None) == (result["swarm_gc_pauses"] == 0)
    assert result["swarm_gc_s"] >= 0
    assert result["swarm_rss_mb_per_agent"] > 0
    assert result["swarm_cpu_ms_per_catchup"] > 0
    assert result["store_planning_bytes_per_engine"] > 0
    assert result["swarm_threads"] >= 2
    assert result["single_catchup_s"] > 0
    # One agent damages every file it keeps for its peers: no engine may use those bytes.
    assert result["commits_differing"] == 0
    assert result["bad_peer_bytes_used"] == 0


def _reserve_in_child(link: SharedLink, size: int, now: float) -> None:
    link.reserve(size, now)


def test_a_shared_link_queues_the_transfers_of_other_processes_too() -> None:
    context = multiprocessing.get_context("spawn")
    link = SharedLink(1000.0, context)
    child = context.Process(target=_reserve_in_child, args=(link, 500, 10.0))
    child.start()
    child.join(60.0)
    assert child.exitcode == 0
    # Queued behind the child's 500 bytes (10.0 → 10.5), then its own 0.5 s.
    assert link.reserve(500, now=10.0) == pytest.approx(11.0)


def test_an_egress_counter_adds_up_the_bytes_and_reads_by_what_was_read() -> None:
    egress = Egress()
    egress.add(100, "fleet/updates/weight_v000002/model-00000-of-00001.safetensors")
    egress.add(23, "fleet/updates/weight_v000002/model.safetensors.index.json")
    egress.add(7, "fleet/updates/weight_v000002/.tether-claim")
    assert (egress.bytes, egress.reads) == (130, 3)
    assert egress.by_kind() == {"shards": 100, "index": 23, "other": 7}


def test_a_link_queues_transfers_behind_each_other_at_its_rate() -> None:
    link = Link(1000.0)
    assert link.reserve(500, now=10.0) == pytest.approx(10.5)
    assert link.reserve(500, now=10.0) == pytest.approx(11.0)
    assert link.reserve(100, now=20.0) == pytest.approx(20.1)
    assert Link(None).reserve(10**9, now=3.0) == 3.0


def test_a_link_sped_up_carries_that_many_times_its_rate_until_set_back() -> None:
    link = Link(1000.0)
    link.factor = 10.0
    assert link.reserve(1000, now=10.0) == pytest.approx(10.1)
    link.factor = 1.0
    assert link.reserve(1000, now=10.0) == pytest.approx(11.1)
    shared = SharedLink(1000.0, multiprocessing.get_context("spawn"))
    shared.factor = 4.0
    assert shared.reserve(1000, now=0.0) == pytest.approx(0.25)


def test_the_fits_recover_a_linear_and_a_logarithmic_fleet() -> None:
    linear = fit([(100, 2.0 + 0.01 * 100), (300, 2.0 + 0.01 * 300), (1000, 12.0)], "linear")
    assert linear.a == pytest.approx(2.0) and linear.b == pytest.approx(0.01)
    assert linear.max_rel_error == pytest.approx(0.0, abs=1e-9)
    assert linear.predict(10_000) == pytest.approx(102.0)
    tree = fit([(n, 1.0 + 0.5 * math.log2(n)) for n in (100, 300, 1000)], "log")
    assert tree.predict(10_000) == pytest.approx(1.0 + 0.5 * math.log2(10_000))


def test_the_anchored_tree_fits_only_the_cost_per_level_and_shows_each_point_s_error() -> None:
    points = [(n, 2.0 + 0.25 * math.log2(n)) for n in (100, 300, 1000)]
    tree = fit(points, "tree", anchor=2.0)
    assert tree.a == 2.0
    assert tree.b == pytest.approx(0.25)
    shown = tree.as_dict()["on_measured"]
    assert [p["engines"] for p in shown] == [100, 300, 1000]
    assert all(p["error"] == pytest.approx(0.0, abs=1e-9) for p in shown)
    # Anchored too low, the fit cannot pass through the points: the errors say so.
    assert fit(points, "tree", anchor=0.0).max_rel_error > 0.01


def test_models_fit_every_form_and_predict_ten_thousand_engines_with_the_best() -> None:
    scales = [{"engines": n, "converged_p99_s": 1.0 + 0.5 * math.log2(n), "single_catchup_s": 1.0}
              for n in (100, 300, 1000)]  # fmt: skip
    fitted = models(scales)
    assert set(fitted["converged_p99"]) == {"linear", "log", "tree"}
    assert fitted["converged_p99_predicted_10000_s"] == pytest.approx(
        1.0 + 0.5 * math.log2(10_000), rel=1e-3
    )


def test_a_histogram_quantile_interpolates_within_its_bucket() -> None:
    buckets = [(0.01, 50.0), (0.02, 90.0), (0.05, 100.0), (math.inf, 100.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.01)
    assert quantile(buckets, 0.7) == pytest.approx(0.015)
    assert quantile(buckets, 0.99) == pytest.approx(0.047)
    assert quantile([(0.01, 0.0), (math.inf, 0.0)], 0.5) is None
    # Past the largest bound, the largest bound is all a histogram can say.
    assert quantile([(0.01, 1.0), (math.inf, 3.0)], 0.9) == 0.01


def test_the_count_above_a_bucket_bound_is_what_the_histogram_held_past_it() -> None:
    buckets = [(0.01, 50.0), (0.05, 97.0), (math.inf, 100.0)]
    assert above(buckets, 0.05) == 3
    assert above(buckets, 0.01) == 50
    with pytest.raises(ValueError, match="not a bucket bound"):
        above(buckets, 0.02)


def _refusal(*args: str) -> str:
    """What `tether bench fleet ARGS` prints refusing them (exit 2, nothing started)."""
    from typer.testing import CliRunner

    from cli import app

    refused = CliRunner().invoke(app, ["bench", "fleet", *args])
    assert refused.exit_code == 2, refused.output
    return " ".join(refused.output.replace("│", " ").split())  # unwrapped from its box


def test_the_fleet_bench_refuses_a_cpu_list_it_cannot_use_before_starting_anything() -> None:
    assert "--controlplane-cpus: 'x' in CPU list 'x' is not a CPU number" in _refusal(
        "--controlplane-cpus", "x"
    )
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert "leaves no CPU for the swarm" in _refusal("--controlplane-cpus", every)


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        # Below the agents' own floor: before, every agent failed to start after the
        # stack was up ("1 validation error for AgentSettings").
        ("--peer-chunk-bytes", "256", "greater than or equal to 1024"),
        ("--agent-link-mbps", "0", "0.0 is not above 0"),
        ("--store-egress-mbps", "-1", "-1.0 is not above 0"),
        ("--heartbeat-s", "0", "0.0 is not above 0"),
        ("--engines", "0", "greater than or equal to 1"),
        ("--shards", "0", "greater than or equal to 1"),
    ],
)
def test_the_fleet_bench_refuses_an_option_out_of_range_naming_it(
    option: str, value: str, says: str
) -> None:
    refused = _refusal(option, value)
    assert f"Invalid value for '{option}'" in refused
    assert says in refused


def test_a_window_is_what_was_observed_between_two_scrapes() -> None:
    before = {"h": [(0.01, 5.0), (math.inf, 7.0)]}
    after = {"h": [(0.01, 8.0), (math.inf, 12.0)]}
    assert window(before, after) == {"h": [(0.01, 3.0), (math.inf, 5.0)]}


def test_the_time_to_a_fraction_counts_the_engines_that_never_got_there() -> None:
    assert fraction_time([1.0, 2.0, 3.0], total=4, fraction=0.5) == 2.0
    assert fraction_time([1.0, 2.0, 3.0], total=4, fraction=0.75) == 3.0
    assert fraction_time([1.0, 2.0, 3.0], total=4, fraction=1.0) is None


def test_the_convergence_deadline_grows_with_one_engines_catch_up_on_slow_links() -> None:
    # Fast links: the fixed deadline. A 156 s single catch-up (0.75 kB/s links): a first
    # catch-up of the fleet that needs ~2,000 s is not cut off at 600 s.
    assert converge_deadline(0.6) == CONVERGE_DEADLINE_S
    assert converge_deadline(156.0) >= 3000.0
