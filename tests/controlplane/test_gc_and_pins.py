"""Versions `store gc` deleted: never pinned under keep_pinned, never listed, and an engine
pinned to one before it was deleted goes back to following latest."""

from __future__ import annotations

from collections.abc import Callable

from launcher.processes import wait_until
from store.store import Store
from tests.controlplane.conftest import Api

KEEP_PINNED = {"kind": "keep_pinned", "engines": 1, "max_lag": 8, "window_s": 600}


def pinned_fleet(make_api: Callable[..., Api], sqlite_url: str) -> tuple[Api, list[str]]:
    api = make_api(sqlite_url, catalog_ttl_s=0.2)
    api.create_run("g")
    for version in (1, 2, 3, 4):
        api.publish("g", version)
    engines = [api.register("g", 4) for _ in range(2)]
    assert api.call("PUT", "/v1/runs/g/policy", "trainer", json=KEEP_PINNED).status_code == 200
    api.settle()
    return api, engines


def targets(api: Api) -> list[int | None]:
    return sorted(e["target_version"] for e in api.call("GET", "/v1/engines").json()["engines"])


def exact(api: Api, version: int) -> dict:
    reply = api.call(
        "POST",
        "/v1/generate",
        "client",
        json={"text": "x", "weight_version": {"exact_version": version}},
    )
    assert reply.status_code == 409, reply.text
    return reply.json()["error"]


def test_a_version_gc_deleted_is_not_pinned_and_is_refused_for_good(
    make_api: Callable[..., Api], sqlite_url: str
) -> None:
    api, _engines = pinned_fleet(make_api, sqlite_url)
    Store(str(api.store_root)).gc("g", keep=1)

    # The first answer may come from a snapshot built before the gc (retryable); the
    # demand it records makes the next snapshot list the store before pinning anything.
    answers: list[dict] = []
    wait_until(
        lambda: answers.append(exact(api, 2)) or not answers[-1]["retryable"],
        10,
        "the deleted version to be refused for good",
    )
    error = answers[-1]
    assert error["type"] == "WeightVersionUnavailable"
    assert error["nearest_servable_version"] == 4
    api.settle()
    assert targets(api) == [4, 4], "no engine is sent to a version that cannot exist"
    listed = api.call("GET", "/v1/runs/g/versions", "client").json()["versions"]
    assert [v["version"] for v in listed] == [4]


def test_an_engine_pinned_to_a_version_that_gc_then_deleted_follows_latest_again(
    make_api: Callable[..., Api], sqlite_url: str
) -> None:
    api, _engines = pinned_fleet(make_api, sqlite_url)
    assert exact(api, 2)["type"] == "WeightVersionNotReady", "v2 exists: worth waiting for"
    wait_until(lambda: targets(api) == [2, 4], 10, "one engine pinned to v2")

    Store(str(api.store_root)).gc("g", keep=1)
    wait_until(lambda: targets(api) == [4, 4], 10, "the pinned engine to follow latest again")
    assert exact(api, 2)["retryable"] is False
