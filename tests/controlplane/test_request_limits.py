"""Requests the control plane refuses before doing any work, in the one JSON error shape:
headers over the cap (431), bodies over the limit however they arrive (413), bodies that
are not JSON it will read (422 naming the problem), an `X-Session-ID` that could not be
forwarded (422), and runs whose store lies outside the configured roots (422)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.controlplane.conftest import Api


@pytest.fixture
def small(make_api: Callable[..., Api], sqlite_url: str) -> Api:
    api = make_api(sqlite_url, max_body_bytes=4096, max_header_bytes=8192)
    api.create_run("lim")
    api.publish("lim", 1)
    return api


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/runs"])
def test_headers_over_the_cap_are_a_431_on_both_lanes(small: Api, path: str) -> None:
    reply = small.call("POST", path, "client", json={"text": "x"}, headers={"X-Pad": "a" * 9000})
    assert reply.status_code == 431
    assert reply.json()["error"]["type"] == "HeadersTooLarge"
    assert reply.json()["error"]["limit"] == 8192


def test_a_chunked_body_over_the_limit_is_a_413_on_fastapi_routes_too(small: Api) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"run_id": "big", "base_checkpoint": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    for path in ("/v1/runs", "/v1/generate"):
        reply = small.call(
            "POST", path, "trainer", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert reply.status_code == 413, (path, reply.text)
        assert reply.json()["error"]["type"] == "BodyTooLarge"
    assert small.call("GET", "/v1/runs/big", "client").status_code == 404, "nothing stored"


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b'{"run_id": "caf\xe9"}', "UTF-8"),
        (b'{"run_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b'{"run_id": "x", "boot_version": ' + b"9" * 5000 + b"}", "number"),
    ],
)
def test_a_body_fastapi_cannot_decode_is_named(api: Api, raw: bytes, problem: str) -> None:
    reply = api.call(
        "POST", "/v1/runs", "trainer", content=raw, headers={"Content-Type": "application/json"}
    )
    assert reply.status_code in (400, 422), reply.text
    error = reply.json()["error"]
    assert error["field"] and error["field"].startswith("body")
    assert problem.lower() in error["message"].lower()


@pytest.mark.parametrize("session", ["s" * 513, "tab\there"])
def test_the_session_header_is_checked_like_the_body_field(small: Api, session: str) -> None:
    for reply in (
        small.call("POST", "/v1/generate", "client", json={"text": "x"},
                   headers={"X-Session-ID": session}),
        small.call("GET", "/v1/route", "client", headers={"X-Session-ID": session}),
    ):  # fmt: skip
        assert reply.status_code == 422, reply.text
        assert reply.json()["error"]["field"] == "header.X-Session-ID"


@pytest.mark.parametrize(
    "store_url", ["/etc", "file:///proc/self", "../store/../../", "/tmp/\x00store"]
)
def test_a_run_store_outside_the_roots_is_refused(api: Api, store_url: str) -> None:
    reply = api.call("POST", "/v1/runs", "trainer", json={"run_id": "x", "store_url": store_url})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["field"] == "body.store_url"
    assert "TETHER_STORE_ROOTS" in error["message"]


def test_a_run_store_under_a_configured_root_is_accepted(
    make_api: Callable[..., Api], sqlite_url: str, tmp_path: Path
) -> None:
    other = tmp_path / "elsewhere"
    api = make_api(sqlite_url, store_roots=f"{tmp_path / 'store'}, file://{other}")
    for run_id, url in (("a", f"{api.store_root}"), ("b", f"file://{other}/team")):
        reply = api.call("POST", "/v1/runs", "trainer", json={"run_id": run_id, "store_url": url})
        assert reply.status_code == 201, reply.text
    sibling = api.call(
        "POST", "/v1/runs", "trainer", json={"run_id": "c", "store_url": f"{other}-2"}
    )
    assert sibling.status_code == 422, "a root is a folder, not a name prefix"
