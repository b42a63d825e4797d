"""Who may call what (every route × every role), and how bad input is answered."""

from __future__ import annotations

import pytest

from tests.controlplane.conftest import Api

ROLES = ("admin", "trainer", "engine", "client", "viewer")
E = "{engine}"

# (method, path, roles allowed besides admin, JSON body)
ROUTES = [
    ("POST", "/v1/tokens", set(), {"role": "client"}),
    ("POST", "/v1/runs", {"trainer"}, {"run_id": "auth-new"}),
    ("GET", "/v1/runs", {"trainer", "engine", "client", "viewer"}, None),
    ("GET", "/v1/runs/auth", {"trainer", "engine", "client", "viewer"}, None),
    ("PUT", "/v1/runs/auth/policy", {"trainer"}, {"kind": "follow_latest"}),
    ("POST", "/v1/runs/auth/versions", {"trainer"}, {"version": 1}),
    ("GET", "/v1/runs/auth/versions", {"trainer", "engine", "client", "viewer"}, None),
    ("GET", "/v1/runs/auth/versions/latest", {"trainer", "engine", "client", "viewer"}, None),
    (
        "GET",
        "/v1/runs/auth/versions/wait?after=5&timeout=0",
        {"trainer", "engine", "client", "viewer"},
        None,
    ),
    ("POST", "/v1/engines", {"engine"}, None),
    ("GET", "/v1/engines", {"trainer", "engine", "client", "viewer"}, None),
    ("GET", f"/v1/engines/{E}", {"trainer", "engine", "client", "viewer"}, None),
    (
        "POST",
        f"/v1/engines/{E}/heartbeat",
        {"engine"},
        {"applied_version": 1, "sync_state": "ready"},
    ),
    ("GET", f"/v1/engines/{E}/target?after=1&timeout=0", {"engine"}, None),
    ("GET", f"/v1/engines/{E}/fetch-plan?version=1", {"engine"}, None),
    (
        "POST",
        f"/v1/engines/{E}/peer-reports",
        {"engine"},
        {"peer_url": "http://127.0.0.1:9", "reason": "stall"},
    ),
    ("GET", "/v1/tokens/self", {"trainer", "engine", "client", "viewer"}, None),
    ("DELETE", f"/v1/engines/{E}", {"engine"}, None),
    ("POST", "/v1/generate", {"client", "trainer"}, {"text": "hi"}),
    ("POST", "/v1/completions", {"client", "trainer"}, {"prompt": "hi"}),
    ("POST", "/v1/chat/completions", {"client", "trainer"}, {"messages": []}),
    ("GET", "/v1/route?run_id=auth", {"client", "trainer"}, None),
    ("GET", "/v1/routes?run_id=auth", {"client", "trainer"}, None),
    ("GET", "/v1/fleet/overview", {"client", "trainer", "viewer"}, None),
    ("GET", "/v1/runs/auth/versions/1/convergence", {"client", "trainer", "viewer"}, None),
    ("POST", "/v1/runs/auth/gap", {"trainer"}, {"step": 1}),
    ("POST", "/v1/sessions", {"client", "trainer"}, {"run_id": "auth"}),
    ("GET", "/v1/sessions/{session_id}", {"client", "trainer"}, None),
    ("GET", "/v1/sessions/{session_id}/trajectory", {"client", "trainer"}, None),
    ("DELETE", "/v1/sessions/{session_id}", {"client", "trainer"}, None),
    ("POST", "/v1/sessions/{session_id}/chat/completions", {"client", "trainer"}, {"messages": []}),
]


@pytest.fixture
def auth_api(api: Api) -> Api:
    api.create_run("auth")
    api.publish("auth", 1)
    return api


def _engine_body() -> dict[str, object]:
    return {"url": "http://127.0.0.1:9", "run_id": "auth", "precision": "bf16"}


def test_every_route_refuses_a_missing_token_and_every_role_it_does_not_allow(
    auth_api: Api,
) -> None:
    api = auth_api
    engine_id = api.register("auth", 1)
    app_paths = {
        (method, route.path)
        for route in api.client.app.routes
        for method in getattr(route, "methods", ())
        if route.path.startswith("/v1/")
    }
    covered = {(m, p.split("?")[0].replace("/auth", "/{run_id}").replace(E, "{engine_id}")
                .replace("/versions/1/", "/versions/{version}/"))
               for m, p, _, _ in ROUTES}  # fmt: skip
    assert app_paths == covered, "every /v1 route must be in the auth matrix"

    for method, path, allowed, body in ROUTES:
        path = path.replace(E, engine_id)
        json_body = _engine_body() if path == "/v1/engines" and method == "POST" else body
        none = api.client.request(method, path, json=json_body)
        assert none.status_code == 401, (method, path, none.text)
        assert none.json()["error"]["type"] == "Unauthorized"
        bogus = api.client.request(
            method, path, json=json_body, headers={"Authorization": "Bearer tth_not-a-token"}
        )
        assert bogus.status_code == 401, (method, path)
        for role in ROLES:
            if role == "admin" or role in allowed:
                continue
            reply = api.call(method, path, role, json=json_body)
            assert reply.status_code == 403, (method, path, role, reply.text)
            assert reply.json()["error"]["type"] == "Forbidden"
        # The admin passes auth everywhere (whatever the route then answers).
        admin = api.call(method, path, "admin", json=json_body)
        assert admin.status_code not in (401, 403), (method, path, admin.text)


def _error(reply) -> dict[str, object]:  # type: ignore[no-untyped-def]
    assert 400 <= reply.status_code < 500, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize(
    ("weight_version", "field"),
    [
        ({"min_version": -1}, "body.weight_version.min_version"),
        ({"exact_version": -3}, "body.weight_version.exact_version"),
        ({"min_version": 1.5}, "body.weight_version.min_version"),
        ({"min_version": "2"}, "body.weight_version.min_version"),
        ({"exact_version": True}, "body.weight_version.exact_version"),
        ({"min_version": 5, "exact_version": 3}, "body.weight_version"),
        ({"min_version": 1, "newest": True}, "body.weight_version.newest"),
        ("latest", "body.weight_version"),
    ],
)
def test_bad_weight_version_is_a_422_naming_the_field(
    auth_api: Api, weight_version: object, field: str
) -> None:
    reply = auth_api.call(
        "POST", "/v1/generate", "client", json={"text": "x", "weight_version": weight_version}
    )
    assert reply.status_code == 422
    error = _error(reply)
    assert error["field"] == field
    assert error["retryable"] is False
    assert error["type"] == "InvalidRequest"


def test_unknown_fields_on_tether_bodies_are_refused_by_name(auth_api: Api) -> None:
    reply = auth_api.call("POST", "/v1/runs", "trainer", json={"run_id": "x1", "colour": "blue"})
    assert reply.status_code == 422
    assert _error(reply)["field"] == "body.colour"
    beat = auth_api.call(
        "POST",
        "/v1/engines",
        "engine",
        json={**_engine_body(), "gpu_count": 8},
    )
    assert _error(beat)["field"] == "body.gpu_count"


def test_negative_or_fractional_versions_are_refused_everywhere(auth_api: Api) -> None:
    api = auth_api
    assert (
        _error(api.call("POST", "/v1/runs/auth/versions", "trainer", json={"version": -1}))["field"]
        == "body.version"
    )
    assert (
        _error(api.call("POST", "/v1/runs/auth/versions", "trainer", json={"version": 1.5}))[
            "field"
        ]
        == "body.version"
    )
    route = api.call("GET", "/v1/route?run_id=auth&min_version=-2", "client")
    assert _error(route)["field"] == "query.min_version"
    both = api.call("GET", "/v1/route?run_id=auth&min_version=4&exact_version=2", "client")
    assert both.status_code == 422


def test_bodies_over_the_configured_limit_are_a_413(make_api, sqlite_url: str) -> None:
    api = make_api(sqlite_url, max_body_bytes=2048)
    api.create_run("big")
    reply = api.call("POST", "/v1/generate", "client", json={"text": "x" * 4096})
    assert reply.status_code == 413
    error = _error(reply)
    assert error["type"] == "BodyTooLarge"
    assert error["field"] == "body"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(8):
            yield b" " * 512

    streamed = api.call(
        "POST", "/v1/generate", "client", content=chunks(),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert streamed.status_code == 413


def test_malformed_json_and_non_object_bodies_are_422(auth_api: Api) -> None:
    raw = auth_api.call(
        "POST", "/v1/generate", "client", content=b"{nope",
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert _error(raw)["field"] == "body"
    listed = auth_api.call("POST", "/v1/generate", "client", json=[1, 2])
    assert _error(listed)["field"] == "body"


def test_a_session_id_that_could_break_the_forwarded_headers_is_refused(auth_api: Api) -> None:
    for bad in ("a\r\nX-Evil: 1", "tab\there", "caf\u00e9"):
        reply = auth_api.call(
            "POST", "/v1/generate", "client", json={"text": "x", "session_id": bad}
        )
        error = _error(reply)
        assert reply.status_code == 422
        assert error["field"] == "body.session_id"
