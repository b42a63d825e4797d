"""`tether bench fleet` at a tiny scale: real agents, real PostgreSQL, real S3, capped links.

The figures are the benchmark's business; these tests check that the swarm runs the whole
agent path (every engine commits every version, over heartbeats and long-polls, with peer
fetch on and one agent serving its peers damaged files), that the caps hold (no engine gets
a version faster than its link carries it), that every engine staged the same weights, and
that the scaling models recover the curves they are fitted to.
"""

from __future__ import annotations

import math

import pytest

from bench.capped_link import Link
from bench.fleet import MB, FleetConfig, fit, fraction_time, measure
from launcher.postgres import find_pg_bin
from launcher.seaweed import find_weed

ENGINES = 4


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.s3
@pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL binaries are not installed")
@pytest.mark.skipif(find_weed() is None, reason="the SeaweedFS 'weed' binary is not installed")
def test_every_engine_of_the_swarm_commits_the_store_s_bytes_despite_a_lying_peer() -> None:
    config = FleetConfig(
        engines=ENGINES, versions=2, model_kb=128, agent_link_mbps=0.5, store_egress_mbps=5.0,
        heartbeat_s=0.5, lease_s=10.0, threads=8, peers=True, bad_peers=1,
    )  # fmt: skip
    result = measure(config, say=lambda _line: None)

    assert result["engines"] == ENGINES
    rows = result["per_version"]
    assert [r["version"] for r in rows] == [2, 3]
    for row in rows:
        assert row["t100_s"] is not None
        # Nobody gets the version faster than their own link carries it.
        assert row["t50_s"] >= row["version_bytes"] / (config.agent_link_mbps * MB)
        # The store served the version at least once, whoever passed it on.
        assert row["store_egress_bytes"] >= row["version_bytes"]
        assert row["woken"] >= 1
    assert result["heartbeats"] > 0
    assert result["heartbeat_p99_ms"] is not None
    assert result["single_catchup_s"] > 0
    # One agent damages every file it keeps for its peers: no engine may use those bytes.
    assert result["commits_differing"] == 0
    assert result["bad_peer_bytes_used"] == 0


def test_a_link_queues_transfers_behind_each_other_at_its_rate() -> None:
    link = Link(1000.0)
    assert link.reserve(500, now=10.0) == pytest.approx(10.5)
    assert link.reserve(500, now=10.0) == pytest.approx(11.0)
    assert link.reserve(100, now=20.0) == pytest.approx(20.1)
    assert Link(None).reserve(10**9, now=3.0) == 3.0


def test_the_fits_recover_a_linear_and_a_logarithmic_fleet() -> None:
    linear = fit([(100, 2.0 + 0.01 * 100), (300, 2.0 + 0.01 * 300), (1000, 12.0)], "linear")
    assert linear.a == pytest.approx(2.0) and linear.b == pytest.approx(0.01)
    assert linear.max_rel_error == pytest.approx(0.0, abs=1e-9)
    assert linear.predict(10_000) == pytest.approx(102.0)
    tree = fit([(n, 1.0 + 0.5 * math.log2(n)) for n in (100, 300, 1000)], "log")
    assert tree.predict(10_000) == pytest.approx(1.0 + 0.5 * math.log2(10_000))


def test_the_time_to_a_fraction_counts_the_engines_that_never_got_there() -> None:
    assert fraction_time([1.0, 2.0, 3.0], total=4, fraction=0.5) == 2.0
    assert fraction_time([1.0, 2.0, 3.0], total=4, fraction=0.75) == 3.0
    assert fraction_time([1.0, 2.0, 3.0], total=4, fraction=1.0) is None
