"""The agent's HTTP server (`_Server`, uvicorn's without its 0.1-s tick): it answers with a
current Date header, stops when told, and wakes once a second, not ten times."""

from __future__ import annotations

import asyncio
import socket
import time
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import pytest
import uvicorn

from engine_agent.agent import _Server

DEADLINE_S = 10.0


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


def test_the_agent_server_answers_with_a_date_stops_when_told_and_never_ticks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks: list[int] = []

    async def counted_tick(self: uvicorn.Server, counter: int) -> bool:
        ticks.append(counter)
        return self.should_exit

    monkeypatch.setattr(_Server, "on_tick", counted_tick)

    async def scenario() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        config = uvicorn.Config(hello, log_level="warning", access_log=False, lifespan="off")
        server = _Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{port}/", timeout=DEADLINE_S)
        assert reply.status_code == 200 and reply.text == "hi"
        sent = parsedate_to_datetime(reply.headers["date"]).timestamp()
        assert abs(sent - time.time()) < 5.0, reply.headers["date"]
        # The Date header is refreshed by one timer, due within the second.
        loop = asyncio.get_running_loop()
        assert server._date is not None
        assert 0.0 < server._date.when() - loop.time() <= 1.0
        server.stop()
        await asyncio.wait_for(serving, DEADLINE_S)
        assert server._date.cancelled(), "the date timer outlived the server"

    asyncio.run(scenario())
    assert ticks == [], "uvicorn's 0.1-s tick loop ran"
