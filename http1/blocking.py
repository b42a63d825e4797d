"""Tether's HTTP/1.1 client for threads: blocking sockets, keep-alive, streamed bodies.

The fetch sources read version files from peers and distributors in worker threads, one
GET at a time each, with the body handed on piece by piece as it arrives (a peer forwards
what it is still receiving). A general-purpose client spends most of such a GET in its own
layers: in a swarm of agents, httpx's sync client was a quarter of the process's GIL time,
most of it reading bodies in small paced pieces (`bench/http_cost.py` measures both). This
one parses with httptools and reads the socket directly.

It does only what those callers need: GET-style requests without a body, a connect
timeout and a read-inactivity timeout (changeable while a body streams), plain TCP or TLS
with a context the caller gives, and a pool of idle connections per origin shared by
threads. No proxies (callers route proxied URLs elsewhere), redirects, cookies or
compression. Transport failures are `UpstreamError`, silences `UpstreamTimeout` (the same
classes as the asyncio client's). Imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import httptools

from http1.client import MAX_REMEMBERED_ORIGINS, Origin, UpstreamError, UpstreamTimeout

_RECV_BYTES = 256 * 1024
_MAX_IDLE_PER_ORIGIN = 8


class _Parsed:
    """httptools' callbacks for one answer: headers, and body pieces not yet handed on."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.pieces: list[bytes] = []
        self.parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: once the message is complete the parser no longer knows.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()


class _Connection:
    def __init__(self, sock: socket.socket, origin: Origin) -> None:
        self.sock = sock
        self.origin = origin
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def shut(self) -> None:
        """End the connection under a thread blocked reading it (a close alone would not
        wake that read)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.close()


class StreamedAnswer:
    """A server's answer whose body is read as it arrives (`iter_bytes`). `close` (run on
    leaving `BlockingClient.stream`'s block) returns the connection to the pool when the
    body was read to its end and the server keeps connections alive, and closes it
    otherwise."""

    def __init__(
        self,
        client: BlockingClient,
        conn: _Connection,
        parser: httptools.HttpResponseParser,
        parsed: _Parsed,
    ) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self._parser = parser
        self._parsed = parsed
        self.status: int = parser.get_status_code()
        self.headers = parsed.headers
        self._until_close = (
            "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
            and self.status not in (204, 304)
        )

    def set_read_timeout(self, seconds: float) -> None:
        """How long the rest of the body may be silent between pieces."""
        if self._conn is not None:
            self._conn.sock.settimeout(seconds)

    def iter_bytes(self) -> Iterator[bytes]:
        """The body's pieces as they arrive; `UpstreamError` if the server breaks off,
        `UpstreamTimeout` if it stays silent past the read timeout."""
        parsed = self._parsed
        while True:
            if parsed.pieces:
                pieces, parsed.pieces = parsed.pieces, []
                yield from pieces
            if parsed.complete:
                return
            conn = self._conn
            if conn is None:
                raise UpstreamError("the answer was closed")
            try:
                data = _recv(conn)
            except UpstreamError:
                data = b""
                if not self._client.closed:
                    raise
            if not data:
                if self._client.closed:
                    raise UpstreamError(f"the client was closed under a read from {_where(conn)}")
                if self._until_close:
                    parsed.complete = True  # the body ran until the server closed, as announced
                    continue
                raise UpstreamError(f"connection to {_where(conn)} closed mid-answer")
            _feed(self._parser, data, conn)

    def close(self) -> None:
        """Done with the answer: the connection is kept only if the body was read whole."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        reusable = self._parsed.complete and self._parsed.keep_alive and not self._until_close
        if reusable:
            self._client._put(conn)
        else:
            self._client._drop(conn)


class BlockingClient:
    """Keep-alive connections per origin, shared by the threads that call `stream`."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 30.0,
        keepalive_s: float = 30.0,
        ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
        max_idle_per_origin: int = _MAX_IDLE_PER_ORIGIN,
    ) -> None:
        """`ssl_context`: for https URLs, or a function that builds it, called at the first
        TLS connection (loading a CA bundle costs 0.1-0.3 s of CPU that a client of plain
        HTTP never needs to pay). Without it, an https URL is an `UpstreamError`."""
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._tls = ssl_context
        self.max_idle_per_origin = max_idle_per_origin
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        # Connections carrying a request: `close` shuts them, so reads under way end at once.
        self._busy: set[_Connection] = set()
        self._origins: dict[str, Origin] = {}
        self._closed = False

    @contextlib.contextmanager
    def stream(
        self,
        url: str,
        headers: dict[str, str] | None = None,
        *,
        method: str = "GET",
        read_timeout_s: float | None = None,
    ) -> Iterator[StreamedAnswer]:
        """Send `method url` (no body); the answer once its head has arrived, its body
        read inside the block.

        A request that dies on a reused connection before a byte of answer came back is
        sent once more on a fresh one: the server closed the idle connection as it was
        reused, so it never saw the request."""
        scheme, _, netloc_and_target = url.partition("://")
        netloc, slash, path = netloc_and_target.partition("/")
        origin = self._origin(url, f"{scheme}://{netloc}")
        target = slash + path or "/"
        lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.host_header.decode()}"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        read_s = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        answer = self._send(origin, head, read_s)
        try:
            yield answer
        finally:
            answer.close()

    def _send(self, origin: Origin, head: bytes, read_s: float) -> StreamedAnswer:
        if self._closed:  # refused before any connection is opened, not only after one
            raise UpstreamError("the client is closed")
        for attempt in (0, 1):
            conn = self._take_idle(origin) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = self._connect(origin)
            with self._lock:
                if self._closed:
                    conn.close()
                    raise UpstreamError("the client is closed")
                self._busy.add(conn)
            try:
                return self._exchange(conn, head, read_s)
            except _NoAnswer as exc:
                self._drop(conn)
                if attempt or not reused:
                    raise exc.error from None
            except BaseException:
                self._drop(conn)
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every connection: idle ones, and those of answers being read, whose reads
        then fail at once (`UpstreamError`) instead of running on."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
            busy, self._busy = self._busy, set()
        for conn in busy:
            conn.shut()
        for conns in idle.values():
            for conn in conns:
                conn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def idle_connections(self) -> int:
        with self._lock:
            return sum(len(conns) for conns in self._idle.values())

    # Connections --------------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of https connections, built now if the client was given a
        function for it; `UpstreamError` if it has none."""
        tls = self._tls
        if tls is None:
            raise UpstreamError("https needs the client's ssl_context")
        if not isinstance(tls, ssl.SSLContext):
            with self._lock:
                if not isinstance(self._tls, ssl.SSLContext):
                    self._tls = tls()
                tls = self._tls
        return tls

    def _origin(self, url: str, base: str) -> Origin:
        origin = self._origins.get(base)
        if origin is None:
            origin = Origin.parse(url)
            if origin.scheme == "https" and self._tls is None:
                raise UpstreamError(f"{url}: https needs the client's ssl_context")
            if len(self._origins) < MAX_REMEMBERED_ORIGINS:
                self._origins[base] = origin
        return origin

    def _connect(self, origin: Origin) -> _Connection:
        where = f"{origin.host}:{origin.port}"
        try:
            sock = socket.create_connection((origin.host, origin.port), self.connect_timeout_s)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"connecting to {where} timed out") from exc
        except OSError as exc:
            raise UpstreamError(f"connecting to {where} failed: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if origin.scheme == "https":
                sock = self.ssl_context().wrap_socket(sock, server_hostname=origin.host)
        except TimeoutError as exc:
            sock.close()
            raise UpstreamTimeout(f"TLS handshake with {where} timed out") from exc
        except OSError as exc:
            sock.close()
            raise UpstreamError(f"TLS handshake with {where} failed: {exc}") from exc
        return _Connection(sock, origin)

    def _take_idle(self, origin: Origin) -> _Connection | None:
        key = (origin.scheme, origin.host, origin.port)
        now = time.monotonic()
        stale = []
        found = None
        with self._lock:
            conns = self._idle.get(key)
            while conns:
                conn = conns.pop()
                if now - conn.idle_since < self.keepalive_s:
                    found = conn
                    break
                stale.append(conn)
        for conn in stale:
            conn.close()
        return found

    def _drop(self, conn: _Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    def _put(self, conn: _Connection) -> None:
        origin = conn.origin
        key = (origin.scheme, origin.host, origin.port)
        conn.idle_since = time.monotonic()
        with self._lock:
            self._busy.discard(conn)
            conns = self._idle.setdefault(key, [])
            if not self._closed and len(conns) < self.max_idle_per_origin:
                conns.append(conn)
                return
        conn.close()

    def _exchange(self, conn: _Connection, head: bytes, read_s: float) -> StreamedAnswer:
        parsed = _Parsed()
        parser = parsed.parser = httptools.HttpResponseParser(parsed)
        sock = conn.sock
        try:
            sock.settimeout(read_s)
            sock.sendall(head)
        except OSError as exc:
            raise _NoAnswer(UpstreamError(f"writing to {_where(conn)} failed: {exc}")) from exc
        received = False
        while not parsed.head_done:
            try:
                data = _recv(conn)
            except UpstreamTimeout:
                raise
            except UpstreamError as exc:
                if received:
                    raise
                raise _NoAnswer(exc) from exc
            if not data:
                error = UpstreamError(f"connection to {_where(conn)} closed before an answer")
                if received:
                    raise error
                raise _NoAnswer(error)
            received = True
            _feed(parser, data, conn)
        return StreamedAnswer(self, conn, parser, parsed)


class _NoAnswer(Exception):
    """The request failed before a byte of answer came back (it may be sent again)."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.error = error


def _where(conn: _Connection) -> str:
    return conn.origin.host_header.decode()


def _recv(conn: _Connection) -> bytes:
    try:
        return conn.sock.recv(_RECV_BYTES)
    except TimeoutError as exc:
        raise UpstreamTimeout(f"{_where(conn)} went silent") from exc
    except OSError as exc:
        raise UpstreamError(f"reading from {_where(conn)} failed: {exc}") from exc


def _feed(parser: httptools.HttpResponseParser, data: bytes, conn: _Connection) -> None:
    try:
        parser.feed_data(data)
    except httptools.HttpParserError as exc:
        raise UpstreamError(f"{_where(conn)}: bad HTTP ({exc})") from exc
