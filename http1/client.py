"""Tether's HTTP/1.1 client for its hot paths: keep-alive connections, one request at a time each.

Owns connecting to a server (plain TCP or TLS), a pool of idle keep-alive connections per
origin with an idle expiry and a cap on open connections, writing a request (the router's
forwarded POST, whose body passes through as the bytes that arrived, or an agent's call to
its control plane), parsing the answer with httptools (Content-Length, chunked, or until
the server closes), the connect timeout and the read-inactivity timeout (per pool, or per
request), and handing a streamed body over chunk by chunk with back-pressure. It does only
what those callers need — no redirects, cookies, proxies or compression — which is why it
costs a fraction of a general-purpose client per request (`bench/http_cost.py`). Transport
failures are `UpstreamError`. Imports nothing of ours: the router (`controlplane`) and the
agents (`engine_agent`) share it.

Why over 500 lines: one connection's life (pool, request writer, response parser, streamed
body) is one concept on the routed request's hot path; split across modules its state
would have to be shared through public attributes.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

# A streamed answer stops being read from the socket while this much is waiting for the
# client, so a slow client slows the engine's connection instead of filling memory.
STREAM_HIGH_WATER = 256 * 1024
MAX_REMEMBERED_ORIGINS = 4096


class UpstreamError(Exception):
    """The server could not be reached or broke off before a complete answer."""


class UpstreamTimeout(UpstreamError):
    """The server did not connect, or went silent, within the configured time."""


@dataclass(frozen=True, eq=False)
class Origin:
    """Where a URL's requests go: the pool key, and the path prefix to put first.

    Compared by identity: `Upstream` keeps one per URL, and a dataclass's field-wise hash
    is a Python call on each of a request's three pool and head lookups.
    """

    scheme: str
    host: str
    port: int
    prefix: bytes
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"engine url {url!r}: expected http://host:port or https://...")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:  # a port that is not a number, or out of range
            raise UpstreamError(f"engine url {url!r}: {exc}") from exc
        return cls(
            scheme=parts.scheme,
            host=parts.hostname,
            port=port,
            prefix=parts.path.rstrip("/").encode(),
            host_header=parts.netloc.encode(),
        )


def proxied(url: str) -> bool:
    """Whether the environment sends requests for `url` through a proxy (httpx's rule:
    the scheme's or ALL_PROXY, unless NO_PROXY names the host)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


class Answer:
    """A server's answer: status, headers (lower-case names) and the body.

    Without streaming the body is complete (`body`) and the connection is already back in
    the pool. With streaming the body arrives through `chunks()`, and the holder must end
    with `release()` (read to the end: the connection may be reused) or `close()`.
    """

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self.body = b""
        self._parts: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._ended = False

    # Fed by the connection --------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._parts.append(data)
        self._buffered += len(data)
        if self._buffered > STREAM_HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        self._complete = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # Read by the holder -----------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises `UpstreamError` if the engine breaks off."""
        while True:
            if self._parts:
                data = self._parts.popleft()
                self._buffered -= len(data)
                if self._buffered <= STREAM_HIGH_WATER // 2:
                    self._conn.resume_reading()
                yield data
                continue
            if self._complete:
                if self._error is not None:
                    raise self._error
                return
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
            self._wakeup = None

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if it can be reused."""
        if not self._ended:
            self._ended = True
            if self._complete and self._error is None:
                self._conn.finished()
            else:
                self._conn.close()

    def close(self) -> None:
        """Done early: the connection is closed, so the engine sees the client leave."""
        if not self._ended:
            self._ended = True
            self._conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a server; carries one request at a time."""

    def __init__(self, pool: Upstream, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        # Per request.
        self.stream = False
        self.waiter: asyncio.Future[Answer] | None = None
        # Instead of `waiter`: told the outcome as soon as it is known (`start`).
        self.on_done: Callable[[Answer | UpstreamError], None] | None = None
        self.answer: Answer | None = None
        self.headers: dict[str, str] = {}
        self.received = False
        self.body_parts: list[bytes] = []
        self.until_close = False
        self.last_read = 0.0
        # The read-inactivity limit of the request in flight (the pool's unless it asked).
        self.timeout_s = pool.read_timeout_s
        # The read-inactivity timer is armed once and lapses when it finds no request in
        # flight (`busy`), rather than being set and cancelled for every request: a timer
        # costs about as much as the rest of the pool's per-request bookkeeping.
        self.timer: asyncio.TimerHandle | None = None
        self.busy = False
        self.drained: asyncio.Future[None] | None = None
        self.paused = False

    # asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio.Transport, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None and self.on_done is None and self.answer is None:
            # Nothing was asked: an engine talking out of turn is not to be trusted.
            self.close()
            return
        self.received = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"{self.origin.host_header.decode()}: bad HTTP ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        if self.answer is not None and self.until_close and not self.answer._complete:
            self._message_done()  # the body ran until the engine closed, as announced
            return
        what = f"connection to {self.origin.host_header.decode()} closed"
        self._fail(UpstreamError(f"{what}: {exc!r}" if exc else what))

    def pause_writing(self) -> None:
        self.drained = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    # httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        headers = self.headers
        status = self.parser.get_status_code()
        self.until_close = (
            "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "").lower()
            and status >= 200
            and status not in (204, 304)
        )
        answer = Answer(self, status, headers)
        self.answer = answer
        if self.stream and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(answer)

    def on_body(self, body: bytes) -> None:
        if self.stream and self.answer is not None:
            self.answer._feed(body)
        else:
            self.body_parts.append(body)

    def on_message_complete(self) -> None:
        self._message_done()

    # Requests ---------------------------------------------------------------------------

    async def request(
        self, head: bytes, body: bytes, stream: bool, timeout_s: float | None = None
    ) -> Answer:
        self.waiter = self.loop.create_future()
        self._send(head, body, stream, timeout_s)
        if self.drained is not None:
            await self.drained
        return await self.waiter

    def start(
        self, head: bytes, body: bytes, on_done: Callable[[Answer | UpstreamError], None]
    ) -> None:
        """Send a request whose complete answer (or failure) goes to `on_done`, called
        from the connection's own callbacks: no task, no future. Not for streams."""
        self.on_done = on_done
        self._send(head, body, False)

    def _send(self, head: bytes, body: bytes, stream: bool, timeout_s: float | None = None) -> None:
        assert self.transport is not None
        self.stream = stream
        self.answer = None
        self.headers = {}
        self.body_parts = []
        self.received = False
        self.last_read = self.loop.time()
        self.busy = True
        self.timeout_s = self.pool.read_timeout_s if timeout_s is None else timeout_s
        due = self.last_read + self.timeout_s
        if self.timer is not None and self.timer.when() > due:
            # Armed for an earlier request with a longer limit (a long-poll): too late.
            self.timer.cancel()
            self.timer = None
        if self.timer is None:
            self.timer = self.loop.call_at(due, self._check)
        try:
            if len(body) < 65536:
                self.transport.write(head + body)
            else:
                self.transport.write(head)  # a large body is not copied into the head
                self.transport.write(body)
        except (OSError, RuntimeError) as exc:
            # The engine closed the connection under us; connection_lost is on its way.
            self._fail(UpstreamError(f"{self.origin.host_header.decode()}: write failed ({exc})"))

    def _message_done(self) -> None:
        answer = self.answer
        if answer is None:
            return
        self.busy = False  # the armed timer lapses by itself (see `__init__`)
        # A connection is reused only when the engine says keep-alive and our request was
        # written in full (an early answer may leave the engine unread bytes).
        keep = (
            self.parser.should_keep_alive()
            and not self.until_close
            and self.transport is not None
            and self.transport.get_write_buffer_size() == 0
        )
        if not keep:
            self.close()
        if self.stream:
            answer._finish()
            return
        answer.body = b"".join(self.body_parts)
        self.body_parts = []
        answer._complete = True
        waiter, done = self.waiter, self.on_done
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)
        self.finished()
        if done is not None:
            done(answer)  # after `finished`: the callee may reuse this very connection

    def finished(self) -> None:
        """The request is over; give the connection back (or let it go when closed)."""
        self.waiter = None
        self.on_done = None
        self.answer = None
        self.pool._put(self)

    def _fail(self, error: UpstreamError) -> None:
        self._stop_timer()
        self.busy = False
        waiter, done = self.waiter, self.on_done
        self.on_done = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        elif self.answer is not None and self.stream and not self.answer._complete:
            self.answer._finish(error)
        self.close()
        if done is not None:
            done(error)

    def _check(self) -> None:
        """The read-inactivity timer: fail the request if the engine went silent."""
        if not self.busy:
            self.timer = None  # no request in flight: the next one arms it again
            return
        if self.paused:
            # Waiting on our own client is not the engine's silence.
            self.last_read = self.loop.time()
        idle = self.loop.time() - self.last_read
        if idle >= self.timeout_s:
            self.timer = None
            self._fail(
                UpstreamTimeout(
                    f"{self.origin.host_header.decode()} sent nothing for {self.timeout_s:g} s"
                )
            )
        else:
            self.timer = self.loop.call_at(self.last_read + self.timeout_s, self._check)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed and self.paused:
            self.paused = False
            self.last_read = self.loop.time()
            self.transport.resume_reading()

    def close(self) -> None:
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()
        self._closed()

    def _closed(self) -> None:
        if not self.closed:
            self.closed = True
            self.resume_writing()  # a writer waiting to drain learns of the close next
            self.pool._gone(self)


class Upstream:
    """Keep-alive connections to servers (the router's: engines), shared by the requests of
    one process (the router) or of one caller (an agent's control-plane client).

    Create it inside the running event loop; `close()` on shutdown.
    """

    def __init__(
        self,
        read_timeout_s: float,
        connect_timeout_s: float = 5.0,
        keepalive_s: float = 4.0,
        max_connections: int = 2048,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context`: for https URLs (default: the system's trust store)."""
        self.loop = asyncio.get_running_loop()
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        # Idle connections are dropped before the engine's server would (uvicorn: 5 s), so
        # a request is rarely written into a connection the engine is closing.
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self._idle: dict[Origin, deque[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._heads: dict[tuple[Origin, str], bytes] = {}
        self._open = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._ssl = ssl_context
        self._closing = False
        # `post_now` requests sent once more on a fresh connection (held until done).
        self._resending: set[asyncio.Task[None]] = set()

    @property
    def open_connections(self) -> int:
        return self._open

    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        extra_headers: tuple[tuple[str, str], ...] = (),
        stream: bool = False,
    ) -> Answer:
        """POST `body` (JSON) to `url` + `path`; the answer, whatever its status.

        A request that dies on a reused connection before a single byte of answer came
        back is sent once more on a fresh one: the engine closed an idle connection at the
        moment it was reused, so it never saw the request.
        """
        origin = self._origin(url)
        head = self._head(origin, path, extra_headers, len(body))
        return await self._exchange(origin, head, body, stream, None)

    async def request(
        self,
        method: str,
        url: str,
        target: str,
        body: bytes = b"",
        extra_headers: tuple[tuple[str, str], ...] = (),
        timeout_s: float | None = None,
    ) -> Answer:
        """`method` `url` + `target` (path and query, already encoded) with `body` (JSON,
        if any); the complete answer, whatever its status. `timeout_s`: this request's
        read-inactivity limit (a long-poll's is longer than the pool's). Sent once more on
        a fresh connection as `post` is."""
        origin = self._origin(url)
        head = self._head(origin, target, extra_headers, len(body), method.encode("ascii"))
        return await self._exchange(origin, head, body, False, timeout_s)

    async def _exchange(
        self, origin: Origin, head: bytes, body: bytes, stream: bool, timeout_s: float | None
    ) -> Answer:
        for attempt in (0, 1):
            conn = await self._acquire(origin, fresh=attempt > 0)
            try:
                return await conn.request(head, body, stream, timeout_s)
            except UpstreamTimeout:
                raise
            except UpstreamError:
                if attempt or not conn.reused or conn.received:
                    raise
            except BaseException:
                conn.close()  # cancelled mid-request: the connection's state is unknown
                raise
        raise AssertionError("unreachable")

    def post_now(
        self,
        url: str,
        path: str,
        body: bytes,
        extra_headers: tuple[tuple[str, str], ...],
        on_done: Callable[[Answer | UpstreamError], None],
    ) -> bool:
        """`post` without a coroutine, for a complete (not streamed) answer: sent at once
        on an idle keep-alive connection, the outcome handed to `on_done` when it is known
        (possibly before this returns). False, with nothing sent, when no idle connection
        is at hand: then `post` must be awaited (it connects)."""
        origin = self._origin(url)
        conn = self._take_idle(origin)
        if conn is None:
            return False
        head = self._head(origin, path, extra_headers, len(body))

        def settled(outcome: Answer | UpstreamError) -> None:
            if (
                isinstance(outcome, UpstreamError)
                and not isinstance(outcome, UpstreamTimeout)
                and not conn.received
            ):
                # The engine closed an idle connection as it was reused: once more on a
                # fresh one, as `post` does.
                task = self.loop.create_task(self._resend(origin, head, body, on_done))
                self._resending.add(task)
                task.add_done_callback(self._resending.discard)
                return
            on_done(outcome)

        conn.start(head, body, settled)
        return True

    async def _resend(
        self,
        origin: Origin,
        head: bytes,
        body: bytes,
        on_done: Callable[[Answer | UpstreamError], None],
    ) -> None:
        try:
            conn = await self._acquire(origin, fresh=True)
            answer = await conn.request(head, body, False)
        except UpstreamError as exc:
            on_done(exc)
            return
        except Exception as exc:
            on_done(UpstreamError(f"{origin.host_header.decode()}: {exc!r}"))
            return
        on_done(answer)

    def _origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) >= MAX_REMEMBERED_ORIGINS:
                # Parsed URLs and request heads are caches; a fleet that churns through
                # many engines must not grow them without end. Idle connections are pooled
                # by Origin identity: with their Origins forgotten they could not be reused.
                self._origins.clear()
                self._heads.clear()
                self._close_idle()
            origin = self._origins[url] = Origin.parse(url)
        return origin

    def _head(
        self,
        origin: Origin,
        path: str,
        extra: tuple[tuple[str, str], ...],
        length: int,
        method: bytes = b"POST",
    ) -> bytes:
        key = (origin, path)
        cached = not extra and method == b"POST"  # the router's forwards: a few paths
        fixed = self._heads.get(key) if cached else None
        if fixed is None:
            if any(c in path for c in " \r\n\0"):
                raise UpstreamError(f"request target {path!r}: must be percent-encoded")
            lines = [
                method + b" " + origin.prefix + path.encode() + b" HTTP/1.1",
                b"Host: " + origin.host_header,
                b"User-Agent: tether",
                b"Content-Type: application/json",
                b"Accept-Encoding: identity",
            ]
            for name, value in extra:
                if any(c in name or c in value for c in "\r\n\0"):
                    raise UpstreamError(f"header {name!r}: line breaks are not allowed")
                lines.append(f"{name}: {value}".encode("latin-1"))
            fixed = b"\r\n".join(lines) + b"\r\nContent-Length: "
            if cached:
                self._heads[key] = fixed
        return fixed + str(length).encode() + b"\r\n\r\n"

    async def _acquire(self, origin: Origin, fresh: bool) -> _Connection:
        while True:
            if not fresh:
                conn = self._take_idle(origin)
                if conn is not None:
                    return conn
            if self._open < self.max_connections:
                return await self._connect(origin)
            if not self._close_an_idle():
                waiter = self.loop.create_future()
                self._waiting.append(waiter)
                await waiter

    def _close_idle(self) -> None:
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close()
        self._idle.clear()

    def _take_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        too_old = self.loop.time() - self.keepalive_s
        while idle and idle[0].idle_since < too_old:
            idle[0].close()  # the oldest first; closing takes it off the deque
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        return None

    def _close_an_idle(self) -> bool:
        for idle in self._idle.values():
            if idle:
                idle[0].close()
                return True
        return False

    async def _connect(self, origin: Origin) -> _Connection:
        if self._closing:
            raise UpstreamError("the router is shutting down")
        self._open += 1
        conn = _Connection(self, origin)
        ssl_context = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        try:
            await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: conn, origin.host, origin.port, ssl=ssl_context
                ),
                self.connect_timeout_s,
            )
        except TimeoutError as exc:
            conn._closed()
            where = origin.host_header.decode()
            raise UpstreamTimeout(
                f"{where}: no connection within {self.connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            conn._closed()
            raise UpstreamError(f"{origin.host_header.decode()}: cannot connect ({exc})") from exc
        except BaseException:
            conn._closed()
            raise
        return conn

    def _put(self, conn: _Connection) -> None:
        if conn.closed or self._closing:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = deque()
        idle.append(conn)
        self._wake_one()

    def _gone(self, conn: _Connection) -> None:
        self._open -= 1
        idle = self._idle.get(conn.origin)
        if idle is not None:
            if conn in idle:
                idle.remove(conn)
            if not idle:
                del self._idle[conn.origin]  # engines come and go; so do their pools
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """Close every idle connection; requests still running finish on theirs."""
        self._closing = True
        self._close_idle()
