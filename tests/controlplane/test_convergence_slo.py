"""Convergence as an SLO: per run and precision, the time from publication until 50/90/99/100 %
of the serving capacity serves a version, the request version lag while it is the latest,
and the bytes engines read for it from the store and from peers — as Prometheus series and
as `GET /v1/runs/{run}/versions/{v}/convergence`."""

from __future__ import annotations

from controlplane.convergence import Convergence
from controlplane.metrics import Metrics
from controlplane.version_lag import VersionLag
from tests.controlplane.conftest import Api
from tests.controlplane.test_dashboard import RUN, snapshot, view
from wire import FetchReport, Precision


def test_thresholds_are_crossed_by_capacity_per_precision_and_for_the_run() -> None:
    metrics = Metrics()
    tracker = Convergence(metrics.registry)
    small = [view(f"b{i}", 0) for i in range(10)]  # ten bf16 engines of capacity 1
    big = view("f0", 0, precision=Precision.FP8, capacity=90)  # one fp8 engine of 90
    tracker.observe(snapshot(100.0, [*small, big], 0, 90.0))
    # v1 at 105: five bf16 engines by 110, the fp8 one by 112, every bf16 one by 130.
    moves = ((110.0, 5, 0), (112.0, 5, 1), (115.0, 9, 1), (130.0, 10, 1))
    for now, bf16_moved, fp8_moved in moves:
        engines = [view(f"b{i}", 1 if i < bf16_moved else 0) for i in range(10)]
        engines.append(view("f0", fp8_moved, precision=Precision.FP8, capacity=90))
        tracker.observe(snapshot(now, engines, 1, 105.0))
    spread = tracker.spread(RUN, 1)
    assert spread is not None
    bf16, fp8 = spread.precisions["bf16"], spread.precisions["fp8"]
    assert bf16.times() == {"t50_s": 5.0, "t90_s": 10.0, "t99_s": 25.0, "t100_s": 25.0}
    assert fp8.times() == {"t50_s": 7.0, "t90_s": 7.0, "t99_s": 7.0, "t100_s": 7.0}
    # The run: 95 of 100 units of capacity are on v1 once the fp8 engine is (t = 7 s),
    # 99 with nine bf16 engines (t = 10 s).
    run = spread.as_dict()
    assert (run["t50_s"], run["t90_s"], run["t99_s"], run["t100_s"]) == (7.0, 7.0, 10.0, 25.0)
    sample = metrics.registry.get_sample_value
    crossed = {"run": RUN, "precision": "fp8", "fraction": "0.99"}
    assert sample("tether_version_reached_seconds_count", crossed) == 1.0
    assert sample("tether_version_reached_seconds_sum", crossed) == 7.0
    # v0 was already everywhere when the tracker first looked: no observation for it.
    assert sample("tether_version_reached_seconds_count", {**crossed, "precision": "bf16"}) == 1


def test_fetch_reports_count_once_per_engine_and_version_by_source() -> None:
    metrics = Metrics()
    tracker = Convergence(metrics.registry)
    engines = [view("a", 0), view("b", 0)]
    tracker.observe(snapshot(10.0, engines, 1, 9.0))
    tracker.note_fetch(engines[0], FetchReport(version=1, store_bytes=1000))
    tracker.note_fetch(engines[0], FetchReport(version=1, store_bytes=1000))  # a repeat
    tracker.note_fetch(engines[1], FetchReport(version=1, store_bytes=10, peer_bytes=990))
    tracker.note_fetch(engines[1], FetchReport(version=7, store_bytes=5))  # not tracked
    spread = tracker.spread(RUN, 1)
    assert spread is not None
    group = spread.precisions["bf16"]
    assert (group.store_bytes, group.peer_bytes, len(group.fetched)) == (1010, 990, 2)
    sample = metrics.registry.get_sample_value
    labels = {"run": RUN, "precision": "bf16"}
    assert sample("tether_version_fetched_bytes_total", {**labels, "source": "store"}) == 1010
    assert sample("tether_version_fetched_bytes_total", {**labels, "source": "peer"}) == 990
    assert sample("tether_latest_version_fetched_bytes", {**labels, "source": "peer"}) == 990
    # A new version starts its own count; the gauge follows it.
    tracker.observe(snapshot(20.0, engines, 2, 19.0))
    assert sample("tether_latest_version_fetched_bytes", {**labels, "source": "peer"}) == 0


def test_request_version_lag_percentiles_are_kept_per_latest_version() -> None:
    lag = VersionLag()
    for applied in [5] * 90 + [4] * 9 + [1]:
        lag.note(RUN, "bf16", 5, applied)
    lag.note(RUN, "fp8", 5, 3)
    lag.note(RUN, "bf16", 6, 6)
    assert lag.figures(RUN, 5, "bf16") == {"requests": 100, "p50": 0, "p90": 0, "p99": 1,
                                           "max": 4}  # fmt: skip
    assert lag.figures(RUN, 5, None)["requests"] == 101
    assert lag.figures(RUN, 5, "fp8") == {"requests": 1, "p50": 2, "p90": 2, "p99": 2, "max": 2}
    assert lag.figures(RUN, 9, None) == {"requests": 0, "p50": None, "p90": None, "p99": None,
                                         "max": None}  # fmt: skip
    family = next(iter(lag.collect()))
    bf16 = {s.labels.get("le"): s.value for s in family.samples
            if s.labels["precision"] == "bf16" and s.name.endswith("_bucket")}  # fmt: skip
    assert bf16["0"] == 91 and bf16["1"] == 100 and bf16["+Inf"] == 101


def test_the_convergence_route_answers_per_precision_with_lag_and_bytes(api: Api) -> None:
    api.create_run(RUN)
    api.publish(RUN, 0)
    bf16 = api.register(RUN, 0)
    fp8 = api.register(RUN, 0, precision="fp8", capacity=3)
    api.settle()
    api.publish(RUN, 1)
    api.settle()
    fetched = {"version": 1, "store_bytes": 300, "peer_bytes": 0}
    assert api.heartbeat(fp8, 1, fetched=fetched).status_code == 200
    api.settle()
    route = api.call("GET", "/v1/route", "client", params={"run_id": RUN})
    assert route.status_code == 200
    reply = api.call("GET", f"/v1/runs/{RUN}/versions/1/convergence", "viewer")
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    assert doc["run_id"] == RUN and doc["version"] == 1 and doc["upper_bound"] is False
    by_precision = {p["precision"]: p for p in doc["precisions"]}
    assert by_precision["fp8"]["t100_s"] is not None and by_precision["fp8"]["store_bytes"] == 300
    assert by_precision["bf16"]["t50_s"] is None and by_precision["bf16"]["serving_fraction"] == 0
    # Three of four units of capacity serve v1: past 50 %, short of 90 %.
    assert doc["run"]["serving_fraction"] == 0.75
    assert doc["run"]["t50_s"] is not None and doc["run"]["t90_s"] is None
    assert doc["run"]["request_lag"]["requests"] == 1
    assert doc["run"]["request_lag"]["max"] in (0, 1)
    assert bf16  # registered, serving v0: counted in the capacity


def test_the_convergence_route_refuses_unknown_versions_runs_and_anonymous_callers(
    api: Api,
) -> None:
    api.create_run(RUN)
    api.publish(RUN, 0)
    api.settle()
    missing = api.call("GET", f"/v1/runs/{RUN}/versions/7/convergence", "viewer")
    assert missing.status_code == 404
    assert "v7" in missing.json()["error"]["message"]
    unknown = api.call("GET", "/v1/runs/nope/versions/0/convergence", "viewer")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "RunUnknown"
    anonymous = api.client.get(f"/v1/runs/{RUN}/versions/0/convergence")
    assert anonymous.status_code == 401
    bad = api.call("GET", f"/v1/runs/{RUN}/versions/x/convergence", "viewer")
    assert bad.status_code == 422
