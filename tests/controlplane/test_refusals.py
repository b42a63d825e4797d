"""What the router answers when it cannot serve a request, by why (docs/api.md, "Refusals").

Only a wait that can end is retryable: an unknown run is a 404, an impossible constraint a
422, a version far above latest a 422, an old version no engine will serve again and a
precision the fleet lacks are non-retryable 409s; a version that is coming is the
retryable 409 with Retry-After.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.controlplane.conftest import Api


def generate(api: Api, **fields: Any) -> Any:
    return api.call("POST", "/v1/generate", "client", json={"text": "x", **fields})


def error_of(reply: Any) -> dict[str, Any]:
    return reply.json()["error"]


@pytest.fixture
def fleet(api: Api) -> Api:
    """Run `r` at v3 (v1..v3 in the store), one bf16 engine on v3 and one on v2."""
    api.create_run("r")
    for version in (1, 2, 3):
        api.publish("r", version)
    api.register("r", 3)
    api.register("r", 2)
    api.settle()
    return api


def test_an_unknown_run_is_a_404_not_a_retry(fleet: Api) -> None:
    for reply in (
        generate(fleet, run_id="ghost"),
        fleet.call("GET", "/v1/route?run_id=ghost", "client"),
    ):
        assert reply.status_code == 404, reply.text
        assert error_of(reply)["type"] == "RunUnknown"
        assert error_of(reply)["retryable"] is False


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"precision": []}, "body.precision"),
        ({"weight_version": {"min_version": 5, "exact_version": 4}}, "body.weight_version"),
        ({"stream": "yes"}, "body.stream"),
        ({"stream": 1}, "body.stream"),
    ],
)
def test_an_impossible_or_ambiguous_request_is_a_422_naming_the_field(
    fleet: Api, fields: dict[str, Any], field: str
) -> None:
    reply = generate(fleet, **fields)
    assert reply.status_code == 422, reply.text
    assert error_of(reply)["field"] == field
    assert error_of(reply)["retryable"] is False


@pytest.mark.parametrize("key", ["exact_version", "min_version"])
def test_a_version_far_above_latest_is_a_422_not_a_wait(fleet: Api, key: str) -> None:
    reply = generate(fleet, weight_version={key: 3 + 1001})
    assert reply.status_code == 422, reply.text
    error = error_of(reply)
    assert error["type"] == "VersionTooFarAhead"
    assert error["field"] == f"body.weight_version.{key}"
    assert error["latest_version"] == 3 and error["max_versions_ahead"] == 1000
    routed = fleet.call("GET", f"/v1/route?{key}=100000", "client")
    assert routed.status_code == 422 and error_of(routed)["field"] == f"query.{key}"


def test_the_next_version_is_a_retryable_409_with_retry_after(fleet: Api) -> None:
    reply = generate(fleet, weight_version={"exact_version": 4})
    assert reply.status_code == 409
    assert error_of(reply)["type"] == "WeightVersionNotReady"
    assert error_of(reply)["retryable"] is True
    assert int(reply.headers["Retry-After"]) >= 1


def test_an_old_version_no_engine_keeps_is_unavailable_with_the_nearest_servable(
    fleet: Api,
) -> None:
    reply = generate(fleet, weight_version={"exact_version": 1})
    assert reply.status_code == 409
    error = error_of(reply)
    assert error["type"] == "WeightVersionUnavailable"
    assert error["retryable"] is False
    assert error["nearest_servable_version"] == 2
    assert error["latest_version"] == 3
    assert "Retry-After" not in reply.headers


def test_under_keep_pinned_an_old_version_in_reach_is_worth_waiting_for(fleet: Api) -> None:
    policy = {"kind": "keep_pinned", "engines": 1, "max_lag": 4}
    assert fleet.call("PUT", "/v1/runs/r/policy", "trainer", json=policy).status_code == 200
    fleet.settle()
    reply = generate(fleet, weight_version={"exact_version": 1})
    assert reply.status_code == 409
    assert error_of(reply)["type"] == "WeightVersionNotReady"
    assert error_of(reply)["retryable"] is True


def test_a_precision_the_fleet_lacks_is_a_non_retryable_409(fleet: Api) -> None:
    reply = generate(fleet, precision=["nvfp4", "fp8"])
    assert reply.status_code == 409
    error = error_of(reply)
    assert error["type"] == "PrecisionNotServed"
    assert error["retryable"] is False
    assert error["requested_precisions"] == ["fp8", "nvfp4"]
    assert error["fleet_precisions"] == ["bf16"]


def test_a_run_without_engines_yet_is_a_retryable_wait(api: Api) -> None:
    api.create_run("empty")
    api.publish("empty", 1)
    api.settle()
    reply = generate(api, run_id="empty", precision="fp8")
    assert reply.status_code == 409
    assert error_of(reply)["type"] == "WeightVersionNotReady"
    assert error_of(reply)["retryable"] is True
