"""The agent's control-plane client on its own transport (`http1`) and through a proxy,
against small servers on 127.0.0.1: answers and their timings reach `on_answer`, a
long-poll keeps its own limit, silence and refusals are `ControlPlaneUnavailable`, and a URL
the environment proxies goes through the proxy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from engine_agent.control_client import ControlClient
from engine_agent.errors import ControlPlaneUnavailable
from http1.client import proxied
from wire import Heartbeat, SyncState

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]
DEADLINE_S = 30.0


def answer(body: dict[str, object], status: str = "200 OK") -> bytes:
    data = json.dumps(body).encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


async def serve(handler: Handler, heads: list[bytes]) -> asyncio.Server:
    """A keep-alive server handing each request's head to `handler` (and to `heads`)."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":", 1)[1]))
                heads.append(head)
                await handler(head, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(connection, "127.0.0.1", 0)


def url_of(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_calls_reach_on_answer_and_a_long_poll_keeps_its_own_limit() -> None:
    answered: list[tuple[str, str, int, bytes]] = []
    release = asyncio.Event()

    async def handler(head: bytes, writer: asyncio.StreamWriter) -> None:
        if b"/heartbeat" in head:
            writer.write(answer({"target_version": 3, "lease_expires_at": 50.0}))
        elif b"/target" in head:
            # Answered only after the heartbeat below: longer than the client's 0.3-s
            # limit for ordinary calls, which a long-poll must not be held to.
            await asyncio.wait_for(release.wait(), DEADLINE_S)
            writer.write(answer({"target_version": 4, "changed": True}))

    async def scenario() -> None:
        heads: list[bytes] = []
        server = await serve(handler, heads)
        control = ControlClient(
            url_of(server),
            token="secret-token",
            timeout_s=0.3,
            on_answer=lambda method, path, status, _s, body: answered.append(
                (method, path, status, body)
            ),
        )
        poll = asyncio.create_task(control.wait_target("e1", after=3, timeout_s=0.1))
        beat = await control.heartbeat("e1", Heartbeat(sync_state=SyncState.READY))
        assert beat.target_version == 3
        await asyncio.sleep(0.5)  # past the 0.3-s limit of ordinary calls
        release.set()
        reply = await asyncio.wait_for(poll, DEADLINE_S)
        assert reply.changed and reply.target_version == 4
        await control.close()
        server.close()
        target = next(h for h in heads if b"/target" in h)
        assert target.startswith(b"GET /v1/engines/e1/target?timeout=0.1&after=3 HTTP/1.1\r\n")
        assert all(b"Authorization: Bearer secret-token" in h for h in heads)

    asyncio.run(scenario())
    assert [(m, p, s) for m, p, s, _ in answered] == [
        ("POST", "/v1/engines/e1/heartbeat", 200),
        ("GET", "/v1/engines/e1/target", 200),
    ]
    assert json.loads(answered[1][3]) == {"target_version": 4, "changed": True}


def test_silence_refusals_and_bad_tokens_are_told_apart() -> None:
    async def silent(head: bytes, writer: asyncio.StreamWriter) -> None:
        if b"/tokens/self" in head:
            writer.write(answer({"detail": "no"}, "401 Unauthorized"))
        elif b"/peer-reports" in head:
            writer.write(answer({"error": {"type": "Invalid"}}, "422 Unprocessable Entity"))
        # a heartbeat gets nothing: the client's limit ends it

    async def scenario() -> None:
        server = await serve(silent, [])
        control = ControlClient(url_of(server), token="t", timeout_s=0.3)
        with pytest.raises(ControlPlaneUnavailable, match="did not answer POST"):
            await control.heartbeat("e1", Heartbeat(sync_state=SyncState.READY))
        assert await control.token_role("Bearer someone-else") is None
        # A header value with a line break is no token; it never reaches the wire.
        assert await control.token_role("Bearer x\r\nX-Evil: 1") is None
        await control.close()
        server.close()

    asyncio.run(scenario())


def test_a_url_the_environment_proxies_goes_through_the_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def as_proxy(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(answer({"target_version": 7, "lease_expires_at": 9.0}))

    async def scenario() -> list[bytes]:
        heads: list[bytes] = []
        proxy = await serve(as_proxy, heads)
        monkeypatch.setenv("HTTP_PROXY", url_of(proxy))
        monkeypatch.setenv("NO_PROXY", "")
        # Never contacted: the proxy answers for it.
        control = ControlClient("http://control-plane.invalid:8000", token="t")
        beat = await control.heartbeat("e1", Heartbeat(sync_state=SyncState.READY))
        assert beat.target_version == 7
        await control.close()
        proxy.close()
        return heads

    heads = asyncio.run(scenario())
    assert heads[0].startswith(
        b"POST http://control-plane.invalid:8000/v1/engines/e1/heartbeat HTTP/1.1"
    )


def test_which_urls_the_environment_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    assert not proxied("http://10.0.0.5:8000")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert proxied("https://cp.example:443") and not proxied("http://cp.example:80")
    monkeypatch.setenv("NO_PROXY", "cp.example")
    assert not proxied("https://cp.example:443")
    monkeypatch.setenv("ALL_PROXY", "http://proxy:3128")
    assert proxied("http://other.example:80") and not proxied("http://cp.example:80")
