"""The whole REST API, on SQLite and on PostgreSQL."""

from __future__ import annotations

import threading

import pytest

from tests.controlplane.conftest import Api, publish


@pytest.fixture
def any_db_api(make_api, db_url: str) -> Api:
    return make_api(db_url)


def test_runs_can_be_created_listed_and_read(any_db_api: Api) -> None:
    api = any_db_api
    created = api.create_run("run-a", base_checkpoint="Qwen/Qwen3-0.6B", boot_version=0)
    assert created["latest_version"] is None
    assert created["policy"]["kind"] == "follow_latest"
    assert created["store_url"] == str(api.store_root)

    listed = api.call("GET", "/v1/runs", "client").json()["runs"]
    assert [r["run_id"] for r in listed] == ["run-a"]
    got = api.call("GET", "/v1/runs/run-a", "engine").json()
    assert got["base_checkpoint"] == "Qwen/Qwen3-0.6B"

    again = api.call("POST", "/v1/runs", "trainer", json={"run_id": "run-a"})
    assert again.status_code == 409
    assert again.json()["error"]["type"] == "RunExists"
    missing = api.call("GET", "/v1/runs/nope", "client")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "RunUnknown"


def test_version_notice_is_accepted_only_once_the_store_pointer_names_it(any_db_api: Api) -> None:
    api = any_db_api
    api.create_run("run-v")
    early = api.call("POST", "/v1/runs/run-v/versions", "trainer", json={"version": 1})
    assert early.status_code == 409
    assert early.json()["error"]["type"] == "VersionNotAtPointer"

    publish(api.store_root, "run-v", 1)
    ahead = api.call("POST", "/v1/runs/run-v/versions", "trainer", json={"version": 2})
    assert ahead.status_code == 409
    assert ahead.json()["error"]["pointer_version"] == 1

    info = api.publish("run-v", 2)
    assert info == {**info, "run_id": "run-v", "version": 2}
    assert api.call("GET", "/v1/runs/run-v", "client").json()["latest_version"] == 2
    versions = api.call("GET", "/v1/runs/run-v/versions", "client").json()["versions"]
    assert [v["version"] for v in versions] == [2]
    latest = api.call("GET", "/v1/runs/run-v/versions/latest", "client").json()
    assert latest["version"] == 2

    # An older notice after the pointer moved on is still true (the pointer is newer).
    old = api.call(
        "POST", "/v1/runs/run-v/versions", "trainer", json={"version": 1, "kind": "full"}
    )
    assert old.status_code == 201
    assert api.call("GET", "/v1/runs/run-v", "client").json()["latest_version"] == 2


def test_version_wait_answers_at_once_times_out_empty_or_wakes_on_publish(
    any_db_api: Api,
) -> None:
    api = any_db_api
    api.create_run("run-w")
    api.publish("run-w", 3)
    now = api.call("GET", "/v1/runs/run-w/versions/wait?after=2&timeout=5", "client")
    assert [v["version"] for v in now.json()["versions"]] == [3]

    empty = api.call("GET", "/v1/runs/run-w/versions/wait?after=3&timeout=0.2", "client")
    assert empty.status_code == 200 and empty.json()["versions"] == []

    result: dict[str, object] = {}
    started = threading.Event()

    def waiter() -> None:
        started.set()
        reply = api.call("GET", "/v1/runs/run-w/versions/wait?after=3&timeout=20", "client")
        result["versions"] = [v["version"] for v in reply.json()["versions"]]

    thread = threading.Thread(target=waiter)
    thread.start()
    started.wait(5)
    api.publish("run-w", 4)
    thread.join(20)
    assert result["versions"] == [4]


def test_engines_register_heartbeat_list_and_deregister(any_db_api: Api) -> None:
    api = any_db_api
    api.create_run("run-e")
    api.publish("run-e", 5)
    reply = api.call(
        "POST",
        "/v1/engines",
        "engine",
        json={
            "url": "http://127.0.0.1:9",
            "run_id": "run-e",
            "precision": "fp8",
            "accelerator": "H100",
            "capacity": 4,
            "labels": {"zone": "a"},
        },
    )
    assert reply.status_code == 201
    registered = reply.json()
    engine_id = registered["engine_id"]
    assert registered["target_version"] == 5
    assert registered["lease_seconds"] > 0 and registered["heartbeat_interval_s"] > 0

    beat = api.heartbeat(
        engine_id, 4, sync_state="syncing", staging_target=5, staging_progress=0.5, in_flight=2
    )
    assert beat.status_code == 200
    assert beat.json()["target_version"] == 5

    listed = api.call("GET", "/v1/engines", "client").json()["engines"]
    assert [e["engine_id"] for e in listed] == [engine_id]
    one = api.call("GET", f"/v1/engines/{engine_id}", "trainer").json()
    assert one["applied_version"] == 4
    assert one["sync_state"] == "syncing"
    assert one["staging_progress"] == 0.5
    assert one["labels"] == {"zone": "a"}
    assert one["precision"] == "fp8"

    target = api.call("GET", f"/v1/engines/{engine_id}/target?after=4&timeout=5", "engine")
    assert target.json() == {"target_version": 5, "changed": True}
    same = api.call("GET", f"/v1/engines/{engine_id}/target?after=5&timeout=0.2", "engine")
    assert same.json() == {"target_version": 5, "changed": False}

    assert api.call("DELETE", f"/v1/engines/{engine_id}", "engine").status_code == 204
    # At once, although the fleet snapshot (which the long-poll reads first) may still
    # list the engine until its next read.
    polled = api.call("GET", f"/v1/engines/{engine_id}/target?after=5&timeout=0.2", "engine")
    assert polled.status_code == 404
    assert polled.json()["error"]["type"] == "EngineUnknown"
    gone = api.heartbeat(engine_id, 5)
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "EngineUnknown"
    assert api.call("GET", "/v1/engines", "client").json()["engines"] == []


def test_engine_target_long_poll_wakes_when_a_version_is_published(any_db_api: Api) -> None:
    api = any_db_api
    api.create_run("run-t")
    api.publish("run-t", 1)
    engine_id = api.register("run-t", 1)
    result = api.target_while_publishing("run-t", engine_id, after=1)
    assert result == {"target_version": 2, "changed": True}


def test_registering_for_an_unknown_run_is_refused(any_db_api: Api) -> None:
    reply = any_db_api.call(
        "POST",
        "/v1/engines",
        "engine",
        json={"url": "http://127.0.0.1:9", "run_id": "ghost", "precision": "bf16"},
    )
    assert reply.status_code == 404
    assert reply.json()["error"]["field"] == "body.run_id"


def test_ops_endpoints_answer_without_a_token(any_db_api: Api) -> None:
    client = any_db_api.client
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert b"tether_requests_total" in metrics.content
    assert client.get("/openapi.json").json()["info"]["title"] == "Tether control plane"


def test_the_target_long_poll_answers_alike_on_the_hot_lane_and_through_fastapi(api: Api) -> None:
    """A publication answers every parked target long-poll of a fleet at once; the hot
    lane serves them without FastAPI's per-request machinery, with the same answers, for
    every outcome, as the FastAPI route declared for OpenAPI."""
    app = api.client.app
    lane = app.hot_lane
    assert lane is not None
    assert lane.path.match("GET", "/v1/engines/e-1/target") is not None
    assert lane.path.match("GET", "/v1/engines/e-1") is None
    assert lane.path.match("POST", "/v1/engines/e-1/target") is None
    api.create_run("poll")
    api.publish("poll", 1)
    engine_id = api.register("poll", 1)
    api.settle()
    asks = [
        (f"/v1/engines/{engine_id}/target?after=0&timeout=5", "engine"),
        (f"/v1/engines/{engine_id}/target?after=1&timeout=0.1", "engine"),
        (f"/v1/engines/{engine_id}/target?timeout=0", "engine"),
        (f"/v1/engines/{engine_id}/target?after=-1", "engine"),
        (f"/v1/engines/{engine_id}/target?after=1&timeout=soon", "engine"),
        (f"/v1/engines/{engine_id}/target?after=1&after=0&timeout=1", "engine"),
        ("/v1/engines/nobody/target?after=1&timeout=0", "engine"),
        (f"/v1/engines/{engine_id}/target?after=1&timeout=0", "client"),
        (f"/v1/engines/{engine_id}/target?after=1&timeout=0", "none"),
    ]

    def answers() -> list[tuple[int, object]]:
        found = []
        for path, role in asks:
            reply = api.client.get(path) if role == "none" else api.call("GET", path, role)
            found.append((reply.status_code, reply.json()))
        return found

    hot = answers()
    app.hot_lane = None  # every request through FastAPI
    try:
        routed = answers()
    finally:
        app.hot_lane = lane
    assert hot == routed
    assert [status for status, _ in hot] == [200, 200, 200, 422, 422, 200, 404, 403, 401]
    assert hot[0][1] == {"target_version": 1, "changed": True}
    assert hot[1][1] == {"target_version": 1, "changed": False}
    assert hot[3][1]["error"]["field"] == "query.after"
    assert hot[4][1]["error"]["field"] == "query.timeout"
