"""The control plane times its own side of the engines' latencies: each heartbeat's time in
its handler, and each target long-poll it answered with a new version (from the version's
publication, or the poll's arrival if later). A long-poll that ends unchanged is not a
wake-up and is not counted."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.controlplane.conftest import Api


def observed(api: Api, name: str) -> tuple[float, float]:
    """(count, sum) of the histogram `name` on the control plane's /metrics."""
    text = api.client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            values = {s.name: s.value for s in family.samples}
            return values[f"{name}_count"], values[f"{name}_sum"]
    raise AssertionError(f"{name} is not exported")


def test_each_heartbeat_is_timed_by_the_control_plane(api: Api) -> None:
    api.create_run("run-h")
    api.publish("run-h", 1)
    engine_id = api.register("run-h", 1)
    before, _ = observed(api, "tether_heartbeat_seconds")

    for _ in range(3):
        assert api.heartbeat(engine_id, 1).status_code == 200

    after, total = observed(api, "tether_heartbeat_seconds")
    assert after - before == 3
    assert total > 0


def test_a_long_poll_woken_by_a_new_version_is_timed_and_an_unchanged_one_is_not(
    api: Api,
) -> None:
    api.create_run("run-w")
    api.publish("run-w", 1)
    engine_id = api.register("run-w", 1)
    result = api.target_while_publishing("run-w", engine_id, after=1)
    assert result == {"target_version": 2, "changed": True}
    woken, seconds = observed(api, "tether_target_wake_seconds")
    assert woken == 1
    assert seconds >= 0

    unchanged = api.call("GET", f"/v1/engines/{engine_id}/target?after=2&timeout=0.2", "engine")
    assert unchanged.json() == {"target_version": 2, "changed": False}
    assert observed(api, "tether_target_wake_seconds")[0] == 1
