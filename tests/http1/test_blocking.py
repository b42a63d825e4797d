"""Tether's HTTP/1.1 client for threads (`http1.blocking`) against scripted TCP servers on
127.0.0.1: keep-alive, chunked and until-close bodies, a server closing an idle connection,
silence, a body broken off, garbage, the client closed under a running read, and a TLS
context built only when an https origin is first reached."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Callable, Iterator

import pytest

from http1.blocking import BlockingClient
from http1.client import UpstreamError, UpstreamTimeout

Handler = Callable[[socket.socket, list[bytes]], None]


def read_head(conn: socket.socket) -> bytes:
    """One request head (b"" when the client closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return b""
        data += piece
    return data


@contextlib.contextmanager
def serve(handler: Handler) -> Iterator[tuple[str, list[bytes], list[int]]]:
    """A TCP server on a free loopback port running `handler(conn, heads)` per connection;
    yields its URL, the request heads seen and a count of accepted connections."""
    server = socket.create_server(("127.0.0.1", 0))
    heads: list[bytes] = []
    accepted: list[int] = []

    def run(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            handler(conn, heads)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                accepted.append(1)
                threading.Thread(target=run, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", heads, accepted
    finally:
        server.close()


def keep_alive(body: bytes) -> Handler:
    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        while head := read_head(conn):
            heads.append(head)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    return handler


def read_all(client: BlockingClient, url: str, **kwargs: object) -> tuple[int, bytes]:
    with client.stream(url, **kwargs) as answer:  # type: ignore[arg-type]
        return answer.status, b"".join(answer.iter_bytes())


def test_requests_share_one_keep_alive_connection_and_carry_their_headers() -> None:
    client = BlockingClient()
    with serve(keep_alive(b"hello")) as (url, heads, accepted):
        for _ in range(3):
            assert read_all(client, f"{url}/files/a%20b?x=1", headers={"Authorization": "B t"}) == (
                200,
                b"hello",
            )
        assert len(accepted) == 1
        assert client.idle_connections() == 1
    first = heads[0].decode()
    assert first.startswith("GET /files/a%20b?x=1 HTTP/1.1\r\n")
    assert f"Host: {url.removeprefix('http://')}\r\n" in first
    assert "Authorization: B t\r\n" in first
    client.close()


def test_a_chunked_body_arrives_piece_by_piece_and_the_connection_is_kept() -> None:
    got_first = threading.Event()

    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        while read_head(conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
            assert got_first.wait(10)  # the second piece only once the first was handed on
            conn.sendall(b"2\r\nde\r\n0\r\n\r\n")

    client = BlockingClient()
    with serve(handler) as (url, _heads, accepted):
        with client.stream(url) as answer:
            pieces = []
            for piece in answer.iter_bytes():
                pieces.append(piece)
                got_first.set()
        assert pieces == [b"abc", b"de"]
        got_first.clear()
        got_first.set()
        assert read_all(client, url) == (200, b"abcde")
        assert len(accepted) == 1
    client.close()


def test_a_body_that_runs_until_close_is_whole_and_its_connection_not_reused() -> None:
    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nall of it")

    client = BlockingClient()
    with serve(handler) as (url, _heads, accepted):
        assert read_all(client, url) == (200, b"all of it")
        assert read_all(client, url) == (200, b"all of it")
        assert len(accepted) == 2
    assert client.idle_connections() == 0


def test_an_idle_connection_the_server_closed_is_replaced_and_the_request_sent_again() -> None:
    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        # ... and the connection is closed, though the answer said nothing of it.

    client = BlockingClient()
    with serve(handler) as (url, _heads, accepted):
        assert read_all(client, url) == (200, b"ok")
        assert client.idle_connections() == 1
        assert read_all(client, url) == (200, b"ok")
        assert len(accepted) == 2


def test_silence_is_a_timeout_and_a_longer_read_timeout_waits_it_out() -> None:
    resume = threading.Event()

    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        while read_head(conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
            resume.wait(10)
            conn.sendall(b"cd")

    client = BlockingClient(read_timeout_s=0.2)
    with serve(handler) as (url, _heads, _accepted):
        with pytest.raises(UpstreamTimeout, match="went silent"), client.stream(url) as answer:
            b"".join(answer.iter_bytes())
        with client.stream(url) as answer:
            answer.set_read_timeout(30.0)
            pieces = answer.iter_bytes()
            assert next(pieces) == b"ab"
            resume.set()
            assert b"".join(pieces) == b"cd"


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed mid-answer"),
        (b"NOT HTTP AT ALL\r\n\r\n", "bad HTTP"),
    ],
    ids=["broken-off", "garbage"],
)
def test_a_broken_answer_is_an_upstream_error(answer: bytes, error: str) -> None:
    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        read_head(conn)
        conn.sendall(answer)

    client = BlockingClient()
    with (
        serve(handler) as (url, _heads, _accepted),
        pytest.raises(UpstreamError, match=error),
    ):
        read_all(client, url)
    assert client.idle_connections() == 0


def test_an_answer_left_before_its_end_closes_its_connection() -> None:
    hung_up = threading.Event()

    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        while read_head(conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nfirst")
            if not conn.recv(1):  # the rest is never sent: the reader must hang up
                hung_up.set()
                return

    client = BlockingClient()
    with serve(handler) as (url, _heads, _accepted):
        with client.stream(url) as answer:
            assert next(answer.iter_bytes()) == b"first"
        assert client.idle_connections() == 0
        assert hung_up.wait(10)


def test_closing_the_client_ends_a_read_under_way_at_once() -> None:
    reading = threading.Event()
    outcome: list[BaseException] = []

    def handler(conn: socket.socket, heads: list[bytes]) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        conn.recv(1)  # the rest never comes: returns when the client shuts the connection

    client = BlockingClient(read_timeout_s=60.0)

    def read() -> None:
        try:
            with client.stream(url) as answer:
                for _piece in answer.iter_bytes():
                    reading.set()
        except BaseException as exc:
            outcome.append(exc)

    with serve(handler) as (url, _heads, _accepted):
        thread = threading.Thread(target=read)
        thread.start()
        assert reading.wait(10)
        client.close()
        thread.join(10)  # far below the 60-s read timeout
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], UpstreamError)
    assert "closed" in str(outcome[0])
    with pytest.raises(UpstreamError, match="closed"), client.stream(url):
        pass


def test_a_refused_connection_and_an_https_url_without_tls_are_clear_errors() -> None:
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    client = BlockingClient()
    refused = f"connecting to 127.0.0.1:{free} failed"
    with pytest.raises(UpstreamError, match=refused), client.stream(f"http://127.0.0.1:{free}/x"):
        pass
    with pytest.raises(UpstreamError, match="ssl_context"), client.stream("https://127.0.0.1:1/x"):
        pass


def test_a_tls_context_given_as_a_function_is_built_at_the_first_https_connection() -> None:
    built: list[ssl.SSLContext] = []

    def context() -> ssl.SSLContext:
        built.append(ssl.create_default_context())
        return built[-1]

    def hang_up(conn: socket.socket, heads: list[bytes]) -> None:
        conn.close()  # no TLS here: the client's handshake meets a closed connection

    client = BlockingClient(ssl_context=context)
    with serve(keep_alive(b"plain")) as (url, _, _):
        assert read_all(client, f"{url}/a") == (200, b"plain")
    assert built == [], "a plain-HTTP request must not load certificates"
    with serve(hang_up) as (url, _, accepted):
        tls_url = url.replace("http://", "https://") + "/a"
        for _ in range(2):
            with pytest.raises(UpstreamError, match="TLS handshake"), client.stream(tls_url):
                pass
        assert len(accepted) == 2
    assert len(built) == 1 and client.ssl_context() is built[0]
    client.close()
