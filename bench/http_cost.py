"""CPU per HTTP request of the ways an agent can call its control plane.

Owns measuring, in one process against a bare asyncio HTTP/1.1 server on loopback, the CPU
(`time.process_time`, client and server together) of one small JSON POST (a heartbeat's
size) made: with `httpx.AsyncClient` as the agent makes it (`base_url` + path), with a new
connection for every request (what an idle expiry shorter than the heartbeat interval
costs), with a pre-built absolute URL, with Tether's own client (`http1`), as the agent's
`ControlClient.heartbeat` makes it now (`http1` plus the wire models), and as a
hand-written HTTP/1.1 exchange on an asyncio stream (the floor). The server's share is the
same small amount in every row, so differences are the client's. Also the ASGI side of an
agent's answer to a peer file GET, before (Starlette's `StreamingResponse`) and now
(`peer_server.send_stream`), with no network. And a fetch source's GET of a peer's file
(14 pieces of 1 KiB, sent one by one by a socket server in a thread) from a worker thread:
through httpx's sync client, as the sources fetched before, and through `HttpSource` on
Tether's blocking client (`http1.blocking`), as now. Prints one JSON line, with
`httpx_over_control_client`: the agent's call before (httpx, the same wire models) over
now, `starlette_over_peer_answer` and `httpx_over_fetch_get`. Never asserts; never used
outside `bench/`.

    python -m bench.http_cost [--requests 2000]
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import typer

BODY = b'{"applied_version": 2, "staging_target": null, "in_flight": 0, "engine_reachable": true}'
REPLY = b'{"target_version": 3, "lease_expires_at": 50.0}'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
    REPLY
)
PATH = "/v1/engines/e/heartbeat"
WARM = 50


class _Server:
    """Answers every request with `REPLY`; knows when its last connection has ended."""

    def __init__(self) -> None:
        self.open = 0
        self.idle = asyncio.Event()

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.idle.clear()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":", 1)[1]))
                writer.write(HEAD + REPLY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.open -= 1
            if self.open == 0:
                self.idle.set()


async def _cpu_ms(requests: int, call: Callable[[], Awaitable[object]]) -> float:
    for _ in range(WARM):
        await call()
    started = time.process_time()
    for _ in range(requests):
        await call()
    return round(1000 * (time.process_time() - started) / requests, 3)


async def measure(requests: int) -> dict[str, float]:
    """CPU milliseconds per request of each way (see the module's docstring)."""
    answers = _Server()
    server = await asyncio.start_server(answers.answer, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    headers = {"content-type": "application/json"}
    result: dict[str, float] = {}
    try:
        for name, expiry in (("httpx_keepalive", 60.0), ("httpx_new_connection", 0.0)):
            limits = httpx.Limits(keepalive_expiry=expiry)
            async with httpx.AsyncClient(base_url=base, limits=limits) as client:

                async def post(client: httpx.AsyncClient = client) -> object:
                    return await client.post(PATH, content=BODY, headers=headers)

                result[f"{name}_ms"] = await _cpu_ms(requests, post)
        url = httpx.URL(base + PATH)
        async with httpx.AsyncClient() as client:

            async def post_url(client: httpx.AsyncClient = client) -> object:
                return await client.post(url, content=BODY, headers=headers)

            result["httpx_absolute_url_ms"] = await _cpu_ms(requests, post_url)
        result.update(await _tether_clients(base, requests))
        result.update(await _peer_answers(requests))
        reader, writer = await asyncio.open_connection("127.0.0.1", url.port)
        request = (
            f"POST {PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY

        async def exchange() -> object:
            writer.write(request)
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            return await reader.readexactly(len(REPLY))

        result["raw_stream_ms"] = await _cpu_ms(requests, exchange)
        writer.close()
        # Every client has left: let the server's connections end before the loop does.
        await asyncio.wait_for(answers.idle.wait(), 10.0)
    finally:
        server.close()
    return result


async def _tether_clients(base: str, requests: int) -> dict[str, float]:
    """The `http1` rows: the bare client, the agent's heartbeat through `ControlClient`, and
    the same heartbeat (wire models included) through httpx, as the agent made it before."""
    from engine_agent.control_client import ControlClient
    from http1.client import Upstream
    from wire import Heartbeat, HeartbeatReply, SyncState

    result: dict[str, float] = {}
    pool = Upstream(read_timeout_s=10.0, keepalive_s=60.0)
    head = (("content-type", "application/json"),)

    async def bare() -> object:
        return await pool.request("POST", base, PATH, BODY, head)

    result["http1_ms"] = await _cpu_ms(requests, bare)
    await pool.close()
    beat = Heartbeat(applied_version=2, sync_state=SyncState.READY)
    control = ControlClient(base, token="t" * 43)

    async def heartbeat() -> object:
        return await control.heartbeat("e", beat)

    result["control_client_ms"] = await _cpu_ms(requests, heartbeat)
    await control.close()
    auth = {"Authorization": "Bearer " + "t" * 43}
    async with httpx.AsyncClient(base_url=base, headers=auth) as client:

        async def heartbeat_httpx(client: httpx.AsyncClient = client) -> object:
            reply = await client.post(
                PATH,
                content=beat.model_dump_json(),
                headers={"content-type": "application/json"},
            )
            return HeartbeatReply.model_validate_json(reply.content)

        result["control_client_httpx_ms"] = await _cpu_ms(requests, heartbeat_httpx)
    result["httpx_over_control_client"] = round(
        result["control_client_httpx_ms"] / result["control_client_ms"], 2
    )
    return result


async def _peer_answers(requests: int) -> dict[str, float]:
    """The ASGI side of a peer file GET, no network: one small file (14 paced pieces of 1
    KiB, as an agent's `PeerServer` sends one) through Starlette's `StreamingResponse`, as
    before, and through `peer_server.send_stream`, as the agent's peer front sends it now.
    The caller stays (its `receive` waits), as callers do."""
    from fastapi.responses import StreamingResponse

    from engine_agent.peer_server import send_stream

    piece = b"x" * 1024
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    stays = asyncio.Event()
    asked = {"sent": False}

    async def receive() -> dict[str, object]:
        if not asked["sent"]:
            asked["sent"] = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(_message: object) -> None:
        pass

    async def pieces() -> AsyncIterator[bytes]:
        for _ in range(14):
            yield piece

    def response() -> StreamingResponse:
        asked["sent"] = False
        headers = {"Content-Length": str(14 * len(piece))}
        return StreamingResponse(pieces(), headers=headers, media_type="application/octet-stream")

    async def starlette() -> None:
        await response()(scope, receive, send)

    async def ours() -> None:
        await send_stream(response(), receive, send)

    result = {
        "peer_answer_starlette_ms": await _cpu_ms(requests, starlette),
        "peer_answer_ms": await _cpu_ms(requests, ours),
    }
    result["starlette_over_peer_answer"] = round(
        result["peer_answer_starlette_ms"] / result["peer_answer_ms"], 2
    )
    return result


def _fetch_gets(requests: int) -> dict[str, float]:
    """CPU per GET of a 14-piece peer file from a thread, httpx then `HttpSource` (see the
    module's docstring); the server thread's share is the same in both."""
    import socket
    import threading

    from store.sources.http import FetchClient, HttpSource

    piece = b"x" * 1024
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (14 * len(piece))
    server = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            buffered = b""
            while True:
                while b"\r\n\r\n" not in buffered:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffered += data
                buffered = buffered.split(b"\r\n\r\n", 1)[1]
                conn.sendall(head)
                for _ in range(14):
                    conn.sendall(piece)

    def accept() -> None:
        try:
            while True:
                conn, _ = server.accept()
                threading.Thread(target=answer, args=(conn,), daemon=True).start()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    size = 14 * len(piece)
    headers = {"Authorization": "Bearer t"}
    timeout = httpx.Timeout(5.0, connect=2.0)

    def timed(get: Callable[[], object]) -> float:
        for _ in range(WARM):
            get()
        started = time.process_time()
        for _ in range(requests):
            get()
        return round(1000 * (time.process_time() - started) / requests, 3)

    with httpx.Client(timeout=timeout) as client:

        def with_httpx() -> object:
            with client.stream("GET", f"{url}/key", headers=headers, timeout=timeout) as reply:
                return b"".join(reply.iter_bytes())

        before = timed(with_httpx)
    fetch_client = FetchClient()
    source = HttpSource(url, token="t", stall_s=5.0, client=fetch_client)
    now = timed(lambda: source.fetch("key", size, sink=lambda _chunk: None))
    fetch_client.close()
    server.close()
    return {
        "fetch_get_httpx_ms": before,
        "fetch_get_ms": now,
        "httpx_over_fetch_get": round(before / now, 2),
    }


def main(requests: int = typer.Option(2000, help="timed requests per way")) -> None:
    result = asyncio.run(measure(requests))
    result.update(_fetch_gets(requests))
    print(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
