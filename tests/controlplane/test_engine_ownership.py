"""An engine belongs to the token that registered it (docs/api.md, "What an engine token
may do"): another engine token cannot heartbeat as it, change it or deregister it, and
registering the same URL again with the same token is the same engine."""

from __future__ import annotations

from typing import Any

import pytest

from tests.controlplane.conftest import Api

URL = "http://127.0.0.1:9/agent-a"


def body(**extra: Any) -> dict[str, Any]:
    return {"url": URL, "run_id": "own", "precision": "bf16", "applied_version": 1,
            "sync_state": "ready", **extra}  # fmt: skip


def as_token(api: Api, token: str, method: str, path: str, **kwargs: Any) -> Any:
    return api.client.request(method, path, headers={"Authorization": f"Bearer {token}"}, **kwargs)


@pytest.fixture
def owned(api: Api) -> tuple[Api, str, str, str]:
    """A run, an engine registered with token A; returns (api, token A, token B, id)."""
    api.create_run("own")
    api.publish("own", 1)
    token_a = api.tokens["engine"]
    token_b = api.call("POST", "/v1/tokens", json={"role": "engine"}).json()["token"]
    reply = as_token(api, token_a, "POST", "/v1/engines", json=body())
    assert reply.status_code == 201, reply.text
    return api, token_a, token_b, reply.json()["engine_id"]


def test_another_engine_token_cannot_heartbeat_as_or_deregister_the_engine(
    owned: tuple[Api, str, str, str],
) -> None:
    api, token_a, token_b, engine_id = owned
    beat = {"applied_version": 1, "sync_state": "draining"}

    stolen = as_token(api, token_b, "POST", f"/v1/engines/{engine_id}/heartbeat", json=beat)
    assert stolen.status_code == 403, stolen.text
    assert stolen.json()["error"]["type"] == "EngineNotOwned"
    removed = as_token(api, token_b, "DELETE", f"/v1/engines/{engine_id}")
    assert removed.status_code == 403
    taken = as_token(api, token_b, "POST", "/v1/engines", json=body(precision="fp8"))
    assert taken.status_code == 409 and taken.json()["error"]["field"] == "body.url"

    row = api.call("GET", f"/v1/engines/{engine_id}", "client").json()
    assert row["sync_state"] == "ready" and row["precision"] == "bf16", "nothing changed"
    ok = as_token(api, token_a, "POST", f"/v1/engines/{engine_id}/heartbeat", json=beat)
    assert ok.status_code == 200, ok.text
    assert api.call("DELETE", f"/v1/engines/{engine_id}").status_code == 204, "admin may"


def test_registering_the_same_url_again_is_the_same_engine_with_one_routing_entry(
    owned: tuple[Api, str, str, str],
) -> None:
    api, token_a, _token_b, engine_id = owned
    again = as_token(api, token_a, "POST", "/v1/engines", json=body(capacity=4))
    assert again.status_code == 201
    assert again.json()["engine_id"] == engine_id
    with_slash = as_token(api, token_a, "POST", "/v1/engines", json=body(url=URL + "/"))
    assert with_slash.json()["engine_id"] == engine_id

    engines = api.call("GET", "/v1/engines", "client").json()["engines"]
    assert [(e["engine_id"], e["capacity"]) for e in engines] == [(engine_id, 1)]


def test_an_engine_may_only_claim_a_version_the_run_knows(owned: tuple[Api, str, str, str]) -> None:
    api, token_a, _token_b, _engine_id = owned
    reply = as_token(
        api, token_a, "POST", "/v1/engines", json=body(url=URL + "-b", applied_version=99)
    )
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == "body.applied_version"
    boot = as_token(
        api, token_a, "POST", "/v1/engines", json=body(url=URL + "-c", applied_version=0)
    )
    assert boot.status_code == 201, "the run's boot version is always known"
