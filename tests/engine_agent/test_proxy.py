"""The versioned proxy of a real agent in front of a real BF16 reference engine, following the
store pointer alone (no control plane) and committing in `quiesce` mode."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from engine_agent.engines.sglang import prepare_body
from engine_agent.gate import AdmissionGate
from engine_agent.proxy import CONTROL_PATHS, VersionedProxy, stamp
from engine_agent.status import AgentStatus
from tests.engine_agent.conftest import (
    VersionChain,
    generate,
    launch_agent,
    server_info,
    wait_agent,
    wait_applied,
)
from tests.fixtures.processes import ManagedProcess, stop_all, wait_until
from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    launch_reference_engine,
    wait_until_ready,
)
from wire import Precision

RUN = "proxy-run"
SHORT = {"max_new_tokens": 3, "temperature": 0.0}


@dataclass
class Single:
    chain: VersionChain
    engine: ReferenceEngineProcess
    agent: ManagedProcess


@pytest.fixture(scope="module")
def single(tiny: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Single]:
    root: Path = tmp_path_factory.mktemp("proxy")
    engine = launch_reference_engine(tiny.bf16, root / "engine.log")
    chain = VersionChain(root / "store", RUN, tiny.bf16)
    agent = launch_agent(
        "agent", engine.url, "bf16", root, store_root=chain.store_root, run_id=RUN,
        boot_model=tiny.bf16, extra=("--pause-mode", "quiesce"),
    )  # fmt: skip
    try:
        wait_until_ready(engine)
        wait_agent(agent)
        wait_applied(agent, 0)
        yield Single(chain, engine, agent)
    finally:
        stop_all([agent, engine])


def test_without_a_control_plane_the_agent_follows_the_store_pointer(single: Single) -> None:
    version = single.chain.publish()
    info = wait_applied(single.agent, version)
    assert info["sync_state"] == "ready" and info["engine_id"] is None
    assert info["pause_mode"] == "quiesce" and info["last_pass"]["outcome"] == "committed"
    assert info["last_pass"]["base"] == version - 1  # caught up from the tensors it held


@pytest.mark.parametrize(
    "path", ["/update_weights_from_disk", "/pause_generation", "/flush_cache", "/abort_request"]
)
def test_engine_control_routes_answer_403_through_the_proxy(single: Single, path: str) -> None:
    reply = httpx.post(f"{single.agent.url}{path}", json={"model_path": "/elsewhere"})
    assert reply.status_code == 403
    assert reply.json()["error"]["type"] == "ControlRouteForbidden"
    assert generate(single.agent.url, {"text": "1 + 1 =", "sampling_params": SHORT}).is_success


def test_answers_are_stamped_and_the_prefix_cache_is_namespaced_by_version(
    single: Single,
) -> None:
    served = server_info(single.agent)["applied_version"]
    body = {
        "text": "2 + 2 =",
        "sampling_params": SHORT,
        "extra_key": "mine",
        "weight_version": {"min_version": 0},
        "precision": "bf16",
        "session_id": "s-1",
    }
    reply = generate(single.agent.url, body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["weight_version_start"] == answer["weight_version_end"] == served
    assert reply.headers["x-tether-weight-version-start"] == str(served)
    assert reply.headers["x-tether-weight-version-end"] == str(served)
    assert answer["meta_info"]["extra_key"] == f"tether-v{served}:mine"

    chat = httpx.post(
        f"{single.agent.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["weight_version_start"] == chat.json()["weight_version_end"] == served


def test_streamed_chunks_are_stamped_and_end_with_done(single: Single) -> None:
    served = server_info(single.agent)["applied_version"]
    body = {"text": "3 + 3 =", "stream": True, "sampling_params": SHORT}
    with httpx.stream("POST", f"{single.agent.url}/generate", json=body, timeout=60) as reply:
        assert reply.headers["x-tether-weight-version-start"] == str(served)
        lines = [line for line in reply.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert len(chunks) == 3
    assert all(c["weight_version_start"] == c["weight_version_end"] == served for c in chunks)
    assert chunks[-1]["meta_info"]["weight_versions"][-1]["version"] == str(served)


def test_a_client_that_leaves_aborts_its_engine_request(single: Single) -> None:
    # No race with the generation's speed: the engine is held (paused in place) before the
    # request arrives, so it cannot answer however fast the machine is. While it is held,
    # the agent lets go of the request only by abandoning its engine request.
    body = json.dumps({"text": "4 + 4 =", "rid": "leaving-client", "sampling_params": SHORT})
    host, port = urlsplit(single.agent.url).hostname, urlsplit(single.agent.url).port

    def agent_in_flight() -> int:
        return server_info(single.agent)["in_flight"]

    hold = httpx.post(f"{single.engine.url}/pause_generation", json={"mode": "in_place"})
    assert hold.status_code == 200, hold.text
    try:
        with socket.create_connection((host, port), timeout=10) as client:
            client.sendall(
                f"POST /generate HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                f"{body}".encode()
            )
            wait_until(lambda: agent_in_flight() == 1, 30.0, "the agent to forward the request")
        # The client hung up with its request unanswered; the engine is still held.
        wait_until(lambda: agent_in_flight() == 0, 30.0, "the agent to abandon the request")
        state = httpx.get(f"{single.engine.url}/server_info", timeout=10).json()
        assert state["internal_states"][0]["paused"], "the engine was held throughout"
    finally:
        httpx.post(f"{single.engine.url}/continue_generation", json={}, timeout=10)

    def engine_idle() -> bool:
        state = httpx.get(f"{single.engine.url}/server_info", timeout=10).json()
        load = state["internal_states"][0]
        return load["in_flight"] == 0 and load["num_running_reqs"] == 0

    wait_until(engine_idle, 30.0, "the engine to be idle")


def test_invalid_or_foreign_requests_are_refused_with_the_error_shape(single: Single) -> None:
    bad = generate(single.agent.url, {"text": "x", "weight_version": {"min_version": -1}})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "InvalidRequest"
    other = generate(single.agent.url, {"text": "x", "precision": "fp8"})
    assert other.status_code == 409 and other.json()["error"]["type"] == "PrecisionNotServed"
    future = generate(single.agent.url, {"text": "x", "weight_version": {"exact_version": 999}})
    assert future.status_code == 409
    assert future.json()["error"]["type"] == "WeightVersionNotReady"


def test_health_and_server_info_describe_the_agent(single: Single) -> None:
    assert httpx.get(f"{single.agent.url}/health").status_code == 200
    info = server_info(single.agent)
    for key in ("applied_version", "sync_state", "staging_progress", "last_error", "passes"):
        assert key in info
    assert info["precision"] == "bf16" and info["run_id"] == RUN
    model = httpx.get(f"{single.agent.url}/model_info", timeout=10).json()
    assert model["weight_version"] == str(info["applied_version"])


def test_an_sglang_body_gets_a_versioned_extra_key_and_a_rid() -> None:
    body = {
        "text": "hi",
        "extra_key": ["a", None],
        "sampling_params": {"max_new_tokens": 1},
    }
    rids = prepare_body(body, 3)
    assert set(body) == {"text", "extra_key", "sampling_params", "rid"}
    assert body["extra_key"] == ["tether-v3:a", "tether-v3"]
    assert rids == [body["rid"]] and body["rid"].startswith("tether-")


def test_stamp_takes_the_span_from_the_engine_and_covers_batches() -> None:
    spans = [{"version": "7", "start": 0, "end": 3}, {"version": "8", "start": 3, "end": 5}]
    batch = [
        {"meta_info": {"weight_version": "8", "weight_versions": spans}},
        {"meta_info": {"weight_version": "7"}},
    ]
    assert stamp(batch, 7) == (7, 8)
    assert (batch[0]["weight_version_start"], batch[0]["weight_version_end"]) == (7, 8)
    assert (batch[1]["weight_version_start"], batch[1]["weight_version_end"]) == (7, 7)
    assert "/update_weights_from_disk" in CONTROL_PATHS


def test_the_proxy_carries_more_concurrent_requests_than_a_small_pool_would() -> None:
    """An engine that answers only once 300 requests are in at once: with the old limit of
    256 connections the rest would wait for ever; with the default 1024 all are answered."""
    wanted = 300

    async def main() -> list[int]:
        arrived = 0
        everyone_in = asyncio.Event()

        async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal arrived
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            arrived += 1
            if arrived == wanted:
                everyone_in.set()
            await everyone_in.wait()
            body = json.dumps({"text": "ok", "meta_info": {"weight_version": "0"}}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(engine, "127.0.0.1", 0, backlog=1024)
        port = server.sockets[0].getsockname()[1]
        proxy = VersionedProxy(
            engine_url=f"http://127.0.0.1:{port}",
            gate=AdmissionGate(served=0),
            status=AgentStatus(applied_version=0, caught_up=True),
            precision=Precision.BF16,
            run_id="r",
            server_info=dict,
        )
        transport = httpx.ASGITransport(app=proxy.app())
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://agent", timeout=60
            ) as client:
                replies = await asyncio.wait_for(
                    asyncio.gather(
                        *(
                            client.post("/generate", json={"text": "x", "sampling_params": {}})
                            for _ in range(wanted)
                        )
                    ),
                    60,
                )
        finally:
            await proxy.close()
            server.close()
        return [r.status_code for r in replies]

    assert asyncio.run(main()) == [200] * wanted
