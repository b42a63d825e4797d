"""Streaming through the router with real processes: a client that leaves mid-stream."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from launcher.processes import ManagedProcess, wait_until
from tests.controlplane.conftest import ADMIN, publish, start_controlplane, start_standin

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
FAST = {"TETHER_SNAPSHOT_REFRESH_S": "0.2", "TETHER_LEASE_SECONDS": "5"}
IN_FLIGHT = re.compile(r'^tether_router_in_flight\{engine="([^"]+)"\} (\S+)$', re.MULTILINE)


def _in_flight(cp: ManagedProcess) -> dict[str, float]:
    """The router's own in-flight count per engine, from /metrics."""
    text = httpx.get(cp.url + "/metrics", timeout=10).text
    return {engine: float(n) for engine, n in IN_FLIGHT.findall(text)}


def _stats(engine: ManagedProcess) -> dict[str, int]:
    return httpx.get(engine.url + "/stats", timeout=10).json()


def _fleet(
    tmp_path: Path, processes: list[ManagedProcess], **env: str
) -> tuple[ManagedProcess, ManagedProcess, str]:
    store = tmp_path / "store"
    store.mkdir()
    log = tmp_path / "cp.log"
    cp = start_controlplane(f"sqlite:///{tmp_path / 'cp.db'}", store, log, **FAST, **env)
    processes.append(cp)
    assert httpx.post(cp.url + "/v1/runs", json={"run_id": "s"}, headers=ADMIN_HEADERS).is_success
    publish(store, "s", 1)
    notified = httpx.post(
        cp.url + "/v1/runs/s/versions", json={"version": 1}, headers=ADMIN_HEADERS
    )
    assert notified.status_code == 201, notified.text
    token = httpx.post(cp.url + "/v1/tokens", json={"role": "engine"}, headers=ADMIN_HEADERS)
    engine = start_standin(1, tmp_path / "engine.log", "--controlplane", cp.url,
                           "--token", token.json()["token"], "--run-id", "s",
                           "--heartbeat-s", "0.2")  # fmt: skip
    processes.append(engine)
    route: dict[str, str] = {}

    def routable() -> bool:
        reply = httpx.get(cp.url + "/v1/route", headers=ADMIN_HEADERS, timeout=10)
        route.update(reply.json() if reply.status_code == 200 else {})
        return reply.status_code == 200

    wait_until(routable, 15, "the stand-in to be routable")
    return cp, engine, route["engine_id"]


def test_a_client_leaving_mid_stream_frees_the_engine_and_closes_its_connection(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    cp, engine, engine_id = _fleet(tmp_path, processes)
    slow = {"text": "x", "stream": True, "chunks": 200, "chunk_delay_s": 0.05}

    # A stream read to the end gives the slot back and is not counted as abandoned.
    whole = httpx.post(
        cp.url + "/v1/generate", json={"text": "x", "stream": True}, headers=ADMIN_HEADERS
    )
    assert whole.status_code == 200 and whole.text.endswith("data: [DONE]\n\n")
    assert _in_flight(cp).get(engine_id) == 0
    assert _stats(engine)["streams_abandoned"] == 0

    with httpx.stream(
        "POST", cp.url + "/v1/generate", json=slow, headers=ADMIN_HEADERS, timeout=30
    ) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert _in_flight(cp).get(engine_id) == 1, "the open stream holds one slot"
        assert _stats(engine)["streaming"] == 1
    # Leaving the block closed the client's connection after one event of 200.

    wait_until(lambda: _in_flight(cp).get(engine_id) == 0, 10, "the router to free the slot")
    wait_until(
        lambda: _stats(engine)["streams_abandoned"] == 1, 10, "the engine to see the client go"
    )
    assert _stats(engine)["streaming"] == 0


def test_a_stream_past_the_byte_cap_ends_with_an_error_event_and_frees_the_engine(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    cp, engine, engine_id = _fleet(tmp_path, processes, TETHER_MAX_STREAM_BYTES="2000")
    reply = httpx.post(
        cp.url + "/v1/generate",
        json={"text": "x", "stream": True, "chunks": 1000, "chunk_delay_s": 0.01},
        headers=ADMIN_HEADERS,
        timeout=30,
    )
    assert reply.status_code == 200
    assert len(reply.content) < 2000 + 1000, "the relay stopped near the cap"
    events = [
        line[len("data: ") :] for line in reply.text.splitlines() if line.startswith("data: ")
    ]
    last = json.loads(events[-1])
    assert last["error"]["type"] == "StreamTooLarge" and last["error"]["limit"] == 2000
    wait_until(lambda: _in_flight(cp).get(engine_id) == 0, 10, "the router to free the slot")
    wait_until(
        lambda: _stats(engine)["streams_abandoned"] == 1, 10, "the engine to stop generating"
    )
