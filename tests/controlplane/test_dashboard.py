"""The fleet overview, the trainer's gap reports, convergence tracking and the dashboard page."""

from __future__ import annotations

import math

import orjson

from controlplane.convergence import Convergence
from controlplane.metrics import Metrics
from controlplane.overview import Overview
from controlplane.snapshot import EngineView, FleetSnapshot, RunView
from launcher.processes import wait_until
from tests.controlplane.conftest import Api
from wire import Precision, SyncState, TargetPolicy

RUN = "dash"


def overview(api: Api, role: str = "viewer") -> dict:
    reply = api.call("GET", "/v1/fleet/overview", role)
    assert reply.status_code == 200, reply.text
    return reply.json()


def view(
    engine_id: str, version: int | None, state: SyncState = SyncState.READY, **kw: object
) -> EngineView:
    values = dict(
        engine_id=engine_id,
        run_id=RUN,
        url=f"http://127.0.0.1:9/{engine_id}",
        precision=Precision.BF16,
        capacity=1,
        applied_version=version,
        sync_state=state,
        in_flight=0,
        staging_target=None,
        staging_progress=0.0,
        staging_started_at=None,
        lease_expires_at=1e12,
    )
    values.update(kw)
    return EngineView(**values)  # type: ignore[arg-type]


def snapshot(
    now: float, engines: list[EngineView], latest: int, published_at: float
) -> FleetSnapshot:
    run = RunView(RUN, latest, published_at, TargetPolicy())
    return FleetSnapshot.build(now, engines, [run], {})


# ---------------------------------------------------------------- the overview route


def test_overview_lists_every_engine_with_served_and_target_versions(api: Api) -> None:
    api.create_run(RUN)
    api.publish(RUN, 0)
    api.publish(RUN, 1)
    old = api.register(
        RUN, 0, precision="bf16", accelerator="h100", engine_kind="vllm", labels={"zone": "a"}
    )
    new = api.register(RUN, 1, precision="fp8", accelerator="b200")
    api.heartbeat(old, 0, sync_state="syncing", staging_target=1, staging_progress=0.4,
                  in_flight=3)  # fmt: skip
    api.settle()

    doc = overview(api)
    rows = {e["engine_id"]: e for e in doc["engines"]}
    assert rows[old]["applied_version"] == 0
    assert rows[old]["target_version"] == 1
    assert rows[old]["sync_state"] == "syncing"
    assert rows[old]["staging_target"] == 1 and rows[old]["staging_progress"] == 0.4
    assert rows[old]["in_flight"] == 3
    assert rows[old]["accelerator"] == "h100" and rows[old]["kind"] == "vllm"
    assert rows[old]["labels"] == {"zone": "a"}
    assert rows[old]["lag"] == 1
    assert rows[new]["applied_version"] == 1 and rows[new]["kind"] == "sglang"  # the default
    assert 0 <= rows[new]["heartbeat_age_s"] < rows[new]["lease_left_s"] + 60
    summary = {p["precision"]: p for p in doc["precisions"]}
    assert summary["bf16"]["versions"] == {"0": 1}
    assert summary["fp8"]["versions"] == {"1": 1}
    assert summary["bf16"]["lag_max"] == 1 and summary["fp8"]["lag_max"] == 0
    (run,) = doc["runs"]
    assert run["latest_version"] == 1
    assert run["timeline"][-1]["version"] == 1


def test_only_viewer_client_trainer_and_admin_tokens_read_the_overview(api: Api) -> None:
    for role in ("viewer", "client", "trainer", "admin"):
        assert api.call("GET", "/v1/fleet/overview", role).status_code == 200, role
    refused = api.call("GET", "/v1/fleet/overview", "engine")
    assert refused.status_code == 403
    assert "viewer" in refused.json()["error"]["message"]
    assert api.client.get("/v1/fleet/overview").status_code == 401


def test_a_viewer_token_changes_nothing(api: Api) -> None:
    api.create_run(RUN)
    assert api.call("POST", "/v1/runs", "viewer", json={"run_id": "x"}).status_code == 403
    assert api.call("POST", "/v1/generate", "viewer", json={"text": "hi"}).status_code == 403
    gap = {"step": 1, "precisions": {"bf16": {"k3_kl": 0.1}}}
    assert api.call("POST", f"/v1/runs/{RUN}/gap", "viewer", json=gap).status_code == 403


def test_the_trainer_reports_its_gap_per_step_and_the_overview_and_metrics_show_it(
    api: Api,
) -> None:
    api.create_run(RUN)
    for step, k3 in ((1, 0.02), (2, 0.05)):
        body = {
            "step": step,
            "trainer_version": step,
            "precisions": {
                "bf16": {"k3_kl": k3 / 10, "tokens": 40},
                "nvfp4": {"k3_kl": k3, "logprob_abs_diff": 0.3, "masked_fraction": 0.1},
            },
            "staleness_mean": 0.5,
            "staleness_max": 1,
        }
        reply = api.call("POST", f"/v1/runs/{RUN}/gap", "trainer", json=body)
        assert reply.status_code == 202, reply.text
        assert reply.json() == {"run_id": RUN, "step": step, "reports": step}
    api.settle()  # the overview lists runs from the snapshot
    (run,) = overview(api, "client")["runs"]
    assert [g["step"] for g in run["gap"]] == [1, 2]
    assert run["gap"][-1]["precisions"]["nvfp4"]["k3_kl"] == 0.05
    assert run["gap"][-1]["staleness_max"] == 1
    text = api.client.get("/metrics").text
    assert f'tether_sampler_gap_k3{{precision="nvfp4",run="{RUN}"}} 0.05' in text
    assert f'tether_rollout_staleness_versions{{run="{RUN}",stat="max"}} 1.0' in text


def test_a_bad_gap_report_names_the_field_and_stores_nothing(api: Api) -> None:
    api.create_run(RUN)
    cases = {
        "body.precisions.fp4": {"step": 1, "precisions": {"fp4": {"k3_kl": 0.1}}},
        "body.step": {"step": -1, "precisions": {}},
        "body.precisions.bf16.k3_kl": {"step": 1, "precisions": {"bf16": {"k3_kl": "nan"}}},
        "body.precisions.bf16.masked_fraction": {
            "step": 1,
            "precisions": {"bf16": {"k3_kl": 0.1, "masked_fraction": 2.0}},
        },
    }
    for field, body in cases.items():
        reply = api.call("POST", f"/v1/runs/{RUN}/gap", "trainer", json=body)
        assert reply.status_code == 422, (field, reply.text)
        assert reply.json()["error"]["field"].startswith(field), reply.json()
    missing = api.call("POST", "/v1/runs/nope/gap", "trainer", json={"step": 1})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "RunUnknown"
    api.settle()  # the overview lists runs from the snapshot
    assert overview(api)["runs"][0]["gap"] == []


def test_a_publish_shows_up_as_a_timeline_entry_that_converges(api: Api) -> None:
    api.create_run(RUN)
    api.publish(RUN, 0)
    engines = [api.register(RUN, 0) for _ in range(2)]
    api.settle()
    api.publish(RUN, 1)
    api.heartbeat(engines[0], 1)
    api.settle()
    entry = overview(api)["runs"][0]["timeline"][-1]
    assert entry["version"] == 1 and entry["serving_fraction"] == 0.5
    assert entry["t50_s"] is not None and entry["t100_s"] is None
    api.heartbeat(engines[1], 1)

    def converged() -> dict | None:
        last = overview(api)["runs"][0]["timeline"][-1]
        return last if last["t100_s"] is not None else None

    done = wait_until(converged, 5.0, "v1 to reach every engine")
    assert done["t50_s"] <= done["t90_s"] <= done["t100_s"]
    assert done["upper_bound"] is False


# ---------------------------------------------------------------- convergence, in memory


def test_convergence_records_when_half_most_and_all_engines_serve_a_version() -> None:
    tracker = Convergence(Metrics().registry)
    fleet = [view(f"e{i}", 0) for i in range(10)]
    tracker.observe(snapshot(100.0, fleet, 0, 90.0))
    for now, moved in ((110.0, 5), (115.0, 9), (130.0, 10)):
        engines = [view(f"e{i}", 1 if i < moved else 0) for i in range(10)]
        tracker.observe(snapshot(now, engines, 1, 105.0))
    (boot, v1) = tracker.timeline(RUN)
    assert boot["upper_bound"] is True  # published before the tracker first looked
    assert (v1["t50_s"], v1["t90_s"], v1["t100_s"]) == (5.0, 10.0, 25.0)
    assert v1["serving_fraction"] == 1.0 and v1["upper_bound"] is False


def test_an_engine_that_skips_a_version_counts_as_serving_it() -> None:
    tracker = Convergence(Metrics().registry)
    tracker.observe(snapshot(1.0, [view("a", 0), view("b", 0)], 0, 0.0))
    tracker.observe(snapshot(2.0, [view("a", 0), view("b", 0)], 1, 1.5))
    tracker.observe(snapshot(3.0, [view("a", 2), view("b", 2)], 2, 2.5))
    v1 = tracker.timeline(RUN)[1]
    assert v1["version"] == 1 and v1["t100_s"] == 1.5


def test_lapsed_leases_and_new_errors_are_counted_but_deregistrations_are_not() -> None:
    metrics = Metrics()
    tracker = Convergence(metrics.registry)
    before = [view("lapses", 0, lease_expires_at=12.0), view("leaves", 0), view("fails", 0)]
    tracker.observe(snapshot(10.0, before, 0, 0.0))
    tracker.observe(snapshot(13.0, [view("fails", 0, SyncState.ERROR)], 0, 0.0))
    tracker.observe(snapshot(14.0, [view("fails", 0, SyncState.ERROR)], 0, 0.0))
    labels = {"run": RUN, "precision": "bf16"}
    sample = metrics.registry.get_sample_value
    assert sample("tether_engine_lease_lapses_total", labels) == 1.0
    assert sample("tether_engine_errors_total", labels) == 1.0


def test_unconverged_seconds_grow_until_the_latest_version_is_everywhere() -> None:
    metrics = Metrics()
    tracker = Convergence(metrics.registry)
    tracker.observe(snapshot(100.0, [view("a", 0), view("b", 0)], 1, 40.0))
    unconverged = ("tether_version_unconverged_seconds", {"run": RUN})
    assert metrics.registry.get_sample_value(*unconverged) == 60.0
    tracker.observe(snapshot(101.0, [view("a", 1), view("b", 1)], 1, 40.0))
    assert metrics.registry.get_sample_value(*unconverged) == 0.0


def test_the_overview_of_1000_engines_is_encoded_once_per_snapshot() -> None:
    overview = Overview(Metrics(), lease_seconds=10.0)
    engines = [
        view(f"e{i:04d}", i % 7, precision=list(Precision)[i % 3], capacity=8, in_flight=i % 5)
        for i in range(1000)
    ]
    overview.observe(snapshot(100.0, engines, 6, 50.0))
    first = overview.encoded()
    assert overview.encoded() is first  # no rebuild without a new snapshot or report
    doc = orjson.loads(first)
    assert len(doc["engines"]) == 1000
    assert sum(p["engines"] for p in doc["precisions"]) == 1000
    assert {p["precision"] for p in doc["precisions"]} == {"bf16", "fp8", "nvfp4"}
    assert all(not math.isnan(p["lag_mean"]) for p in doc["precisions"])
    overview.observe(snapshot(101.0, engines, 6, 50.0))
    assert overview.encoded() is not first


# ---------------------------------------------------------------- the page


def test_the_page_and_its_assets_are_served_with_a_strict_content_policy(api: Api) -> None:
    page = api.client.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/dashboard.js"' in page.text
    script = api.client.get("/dashboard/dashboard.js")
    assert script.status_code == 200 and "/v1/fleet/overview" in script.text
    assert "console.log" not in script.text  # the token is never logged
    assert api.client.get("/dashboard/dashboard.css").status_code == 200
    missing = api.client.get("/dashboard/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFound"
