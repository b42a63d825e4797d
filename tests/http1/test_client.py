"""Tether's HTTP/1.1 client (`http1`) against real servers on 127.0.0.1.

The ordinary cases run against the engine stand-in (uvicorn); the protocol edge cases —
chunked and until-close bodies, an engine closing an idle connection, silence, garbage,
a stream broken off — against small scripted TCP servers, since no well-behaved server
produces them on demand.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from http1 import client as upstream
from http1.client import (
    STREAM_HIGH_WATER,
    Answer,
    Upstream,
    UpstreamError,
    UpstreamTimeout,
)
from launcher.processes import ManagedProcess
from tests.controlplane.conftest import start_standin

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request from the client: (head, body); empty head when the client closed."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def reply(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"\r\n"
        + body
    )


async def answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request on the connection with `ok`, keeping it alive."""
    while (await read_request(reader))[0]:
        writer.write(reply(b"ok"))
        await writer.drain()


async def serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A TCP server on a free loopback port; the list counts accepted connections."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", accepted


async def until(check: Callable[[], bool], deadline_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not check():
        if loop.time() > end:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


def test_keep_alive_reuses_one_connection_against_a_real_engine(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    engine = start_standin(4, tmp_path / "engine.log")
    processes.append(engine)

    async def main() -> list[Answer]:
        client = Upstream(read_timeout_s=10)
        try:
            answers = []
            for i in range(20):
                body = json.dumps({"text": f"hi {i}", "weight_version": {"min_version": 4}})
                answers.append(await client.post(engine.url, "/generate", body.encode()))
            assert client.open_connections == 1
            assert client.idle_connections() == 1
            refused = await client.post(
                engine.url, "/generate", b'{"weight_version": {"exact_version": 9}}'
            )
            assert refused.status == 409
            assert json.loads(refused.body)["error"]["type"] == "WeightVersionNotReady"
            assert client.open_connections == 1  # a 409 with a body keeps the connection
            return answers
        finally:
            await client.close()

    answers = asyncio.run(main())
    assert [a.status for a in answers] == [200] * 20
    assert all(json.loads(a.body)["weight_version_start"] == 4 for a in answers)
    assert answers[0].headers["content-type"].startswith("application/json")


def test_chunked_and_until_close_bodies_are_read_whole() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )
        await writer.drain()
        await read_request(reader)  # keep-alive: a second request on the same connection
        writer.write(reply(b"again"))
        await writer.drain()
        await reader.read()

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async def main() -> None:
        client = Upstream(read_timeout_s=5)
        server, url, accepted = await serve(chunked)
        try:
            first = await client.post(url, "/generate", b"{}")
            second = await client.post(url, "/generate", b"{}")
            assert (first.body, second.body) == (b"hello world", b"again")
            assert len(accepted) == 1
        finally:
            server.close()
            await client.close()
        client = Upstream(read_timeout_s=5)
        server, url, accepted = await serve(until_close)
        try:
            answer = await client.post(url, "/generate", b"{}")
            assert answer.body == b"all of it"
            await until(lambda: client.open_connections == 0)  # not kept: it was closed
        finally:
            server.close()
            await client.close()

    asyncio.run(main())


def test_an_idle_connection_the_engine_closed_is_replaced_without_an_error() -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply(b"1"))
        await writer.drain()
        # Claims keep-alive, then drops the connection while the client holds it idle.

    async def main() -> None:
        client = Upstream(read_timeout_s=5)
        server, url, accepted = await serve(one_then_close)
        try:
            assert (await client.post(url, "/generate", b"{}")).body == b"1"
            assert (await client.post(url, "/generate", b"{}")).body == b"1"
            assert len(accepted) == 2
            # The same through `post_now`: its resend takes a task, the outcome still comes.
            outcome = await post_now(client, url)
            assert isinstance(outcome, Answer) and outcome.body == b"1"
            assert len(accepted) == 3
        finally:
            server.close()
            await client.close()

    asyncio.run(main())


def test_forgetting_the_parsed_urls_closes_the_idle_connections_they_pooled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upstream, "MAX_REMEMBERED_ORIGINS", 2)

    async def main() -> None:
        client = Upstream(read_timeout_s=5)
        servers = [await serve(answer_ok) for _ in range(3)]
        try:
            for _server, url, _accepted in servers[:2]:
                assert (await client.post(url, "/generate", b"{}")).body == b"ok"
            assert client.idle_connections() == 2
            # A third engine: the two remembered URLs are forgotten, and the connections
            # pooled under them closed (no request could take them any more).
            assert (await client.post(servers[2][1], "/generate", b"{}")).body == b"ok"
            await until(lambda: client.open_connections == 1)
            first_url, first_accepted = servers[0][1], servers[0][2]
            assert (await client.post(first_url, "/generate", b"{}")).body == b"ok"
            assert len(first_accepted) == 2, "a new connection to the first engine"
        finally:
            for server, _url, _accepted in servers:
                server.close()
            await client.close()

    asyncio.run(main())


def test_silence_times_out_and_garbage_or_refusal_is_an_upstream_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # never answers

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 nonsense\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        client = Upstream(read_timeout_s=0.3)
        server, url, _ = await serve(silent)
        loop = asyncio.get_running_loop()
        try:
            began = loop.time()
            with pytest.raises(UpstreamTimeout, match=r"sent nothing for 0\.3 s"):
                await client.post(url, "/generate", b"{}")
            # Never early; how late depends on the machine's load, so no upper bound.
            assert loop.time() - began >= 0.25
        finally:
            server.close()
        server, url, _ = await serve(garbage)
        try:
            with pytest.raises(UpstreamError, match="bad HTTP"):
                await client.post(url, "/generate", b"{}")
        finally:
            server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await client.post(url, "/generate", b"{}")
        await until(lambda: client.open_connections == 0)
        await client.close()

    asyncio.run(main())


def test_a_stream_arrives_in_order_with_back_pressure_and_a_break_is_an_error() -> None:
    chunk = b"x" * 65536
    total_chunks = 16  # 1 MiB, four times the high-water mark

    async def big_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(total_chunks):
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def broken_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.transport.abort()

    async def main() -> None:
        client = Upstream(read_timeout_s=5)
        server, url, _ = await serve(big_stream)
        try:
            answer = await client.post(url, "/generate", b"{}", stream=True)
            assert answer.status == 200
            assert answer.headers["content-type"] == "text/event-stream"
            # Nobody reads yet: the connection stops reading past the high-water mark.
            await until(lambda: answer._conn.paused)
            assert answer._buffered <= STREAM_HIGH_WATER + 4 * len(chunk)
            received = b"".join([part async for part in answer.chunks()])
            assert received == chunk * total_chunks
            answer.release()
            assert client.idle_connections() == 1  # read to the end: reusable
        finally:
            server.close()
        server, url, _ = await serve(broken_stream)
        try:
            answer = await client.post(url, "/generate", b"{}", stream=True)
            parts = []
            with pytest.raises(UpstreamError, match="closed"):
                async for part in answer.chunks():
                    parts.append(part)
            assert parts == [b"hello"]
            answer.release()
        finally:
            server.close()
            await client.close()

    asyncio.run(main())


def test_closing_a_stream_early_closes_the_engine_connection() -> None:
    async def main() -> None:
        eof = asyncio.Event()

        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"4\r\ndata\r\n")
            await writer.drain()
            await reader.read()  # returns at EOF: the client closed the connection
            eof.set()

        client = Upstream(read_timeout_s=5)
        server, url, _ = await serve(endless)
        try:
            answer = await client.post(url, "/generate", b"{}", stream=True)
            async for part in answer.chunks():
                assert part == b"data"
                break
            answer.close()
            await asyncio.wait_for(eof.wait(), 5)
            assert client.open_connections == 0
        finally:
            server.close()
            await client.close()

    asyncio.run(main())


def test_the_connection_cap_queues_requests_instead_of_opening_more() -> None:
    async def main() -> None:
        live = 0
        most = 0

        async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal live, most
            live += 1
            most = max(most, live)
            try:
                while True:
                    head, _ = await read_request(reader)
                    if not head:
                        return
                    await asyncio.sleep(0.05)
                    writer.write(reply(b"ok"))
                    await writer.drain()
            finally:
                live -= 1

        client = Upstream(read_timeout_s=5, max_connections=2)
        server, url, accepted = await serve(slow)
        try:
            answers = await asyncio.gather(
                *(client.post(url, "/generate", b"{}") for _ in range(6))
            )
            assert [a.body for a in answers] == [b"ok"] * 6
            assert most <= 2 and len(accepted) == 2
        finally:
            server.close()
            await client.close()

    asyncio.run(main())


def test_header_values_cannot_smuggle_lines_and_bad_urls_are_refused() -> None:
    async def main() -> None:
        client = Upstream(read_timeout_s=5)
        with pytest.raises(UpstreamError, match="header"):
            await client.post(
                "http://127.0.0.1:9", "/generate", b"{}", (("X-Session-ID", "a\r\nEvil: 1"),)
            )
        with pytest.raises(UpstreamError, match="expected http"):
            await client.post("ftp://127.0.0.1:9", "/generate", b"{}")
        await client.close()

    asyncio.run(main())


async def post_now(client: Upstream, url: str) -> Answer | UpstreamError:
    """`post_now`, awaited by the test through a future its callback resolves."""
    done: asyncio.Future[Answer | UpstreamError] = asyncio.get_running_loop().create_future()
    assert client.post_now(url, "/generate", b"{}", (), done.set_result)
    return await done


def test_post_now_sends_only_on_an_idle_connection_and_reports_the_answer() -> None:
    async def main() -> None:
        client = Upstream(read_timeout_s=5)
        server, url, accepted = await serve(answer_ok)
        try:
            # No idle connection yet: nothing is sent, the caller must await `post`.
            assert not client.post_now(url, "/generate", b"{}", (), lambda _: None)
            assert (await client.post(url, "/generate", b"{}")).body == b"ok"
            for _ in range(3):
                outcome = await post_now(client, url)
                assert isinstance(outcome, Answer) and outcome.body == b"ok"
            assert len(accepted) == 1  # every one on the kept connection
        finally:
            server.close()
            await client.close()

    asyncio.run(main())


def test_silence_on_a_reused_connection_still_times_out() -> None:
    """The read timer is armed once per connection and renews itself: a request on a kept
    connection, long after the timer's first deadline, still fails when the engine goes
    silent, through `post` and through `post_now`."""

    async def then_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply(b"1"))
        await writer.drain()
        await read_request(reader)
        await reader.read()  # never answers again

    async def main() -> None:
        client = Upstream(read_timeout_s=0.3)
        loop = asyncio.get_running_loop()
        for send in ("post", "post_now"):
            server, url, _ = await serve(then_silent)
            try:
                assert (await client.post(url, "/generate", b"{}")).body == b"1"
                await asyncio.sleep(0.4)  # the first request's deadline passes while idle
                began = loop.time()
                if send == "post":
                    with pytest.raises(UpstreamTimeout):
                        await client.post(url, "/generate", b"{}")
                else:
                    assert isinstance(await post_now(client, url), UpstreamTimeout)
                assert loop.time() - began >= 0.25  # never early; no upper bound (load)
            finally:
                server.close()
        await client.close()

    asyncio.run(main())
