"""How a control-plane process serves HTTP: uvicorn, with limits the app cannot set.

Owns the server's configuration: the HTTP protocol (httptools, with a cap on the bytes of
a request's head, which the parser would otherwise buffer without limit until the head
ends: a 64 MB header must not get around the 8 MiB body limit), keep-alive, and a bounded
graceful shutdown so SIGTERM ends the process promptly even while long-polls are open.
Never builds the application's state itself (that is `app.create_app`).
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from controlplane import hot_exchange
from controlplane.draining import begin as begin_draining
from controlplane.middleware import headers_too_large
from controlplane.settings import ControlPlaneSettings

# The request line and framing on top of the headers the app-level check counts.
HEAD_SLACK_BYTES = 16 * 1024
# How long a connection whose head was refused keeps draining before it is closed.
LINGER_S = 5.0


@lru_cache(maxsize=1)
def head_limit() -> int:
    """The most bytes a request head may take in this process (from TETHER_* settings)."""
    return ControlPlaneSettings().max_header_bytes + HEAD_SLACK_BYTES


class CappedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol that answers 431 (in the shared JSON error shape) and
    closes the connection once a request's head passes `limit_bytes` (set by `run`; in
    worker processes, from the environment), and hands the hot lane's requests to its own
    exchange (`hot_exchange.py`) instead of an ASGI cycle."""

    limit_bytes: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limit = self.limit_bytes if self.limit_bytes is not None else head_limit()
        self._in_head = False
        self._head_bytes = 0
        self._refused = False
        # The hot exchange's keep-alive expiry: one timer that re-arms itself while the
        # connection keeps being used, instead of uvicorn's set-and-cancel per request.
        self._idle_since: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused head: read and dropped, never buffered
        super().data_received(data)
        # Counted after parsing: bytes count only while the head is still incomplete, so a
        # chunk that finishes the head and carries a body is not held against it.
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self._limit:
                self._refuse()

    def on_message_begin(self) -> None:
        # uvicorn's ASGI scope (two dicts and a copy of the app state per request) is built
        # only for a request the hot exchange leaves to ASGI (`_asgi_scope`); until the head
        # is complete nothing reads it.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._in_head = True

    def _asgi_scope(self) -> None:
        """uvicorn's own start of a request, keeping the URL and headers parsed since."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.expect_100_continue = url, expect
        self.headers.extend(headers)  # the list the new scope holds

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        if not hot_exchange.start(self, self.hot_response_complete):
            self._asgi_scope()
            super().on_headers_complete()

    def _unset_keepalive_if_required(self) -> None:
        # Called by uvicorn whenever bytes arrive or an answer ends: the connection is busy.
        self._idle_since = None
        super()._unset_keepalive_if_required()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        cycle = self.cycle
        super().connection_lost(exc)
        if isinstance(cycle, hot_exchange.HotExchange):
            cycle.gone_before_body()

    def on_body(self, body: bytes) -> None:
        cycle: object = self.cycle
        if not isinstance(cycle, hot_exchange.HotExchange):
            super().on_body(body)
            return
        # uvicorn's steps for its own cycle, less the upgrade check: the exchange never
        # takes an upgrade.
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()
        if self.flow.read_paused:
            cycle.body_past_buffer()

    def on_message_complete(self) -> None:
        cycle: object = self.cycle
        if not isinstance(cycle, hot_exchange.HotExchange):
            super().on_message_complete()
            return
        if cycle.response_complete:
            return
        cycle.more_body = False
        cycle.message_event.set()
        cycle.body_complete()

    def hot_response_complete(self) -> None:
        """The hot exchange's answer is out: what uvicorn does when a response completes
        (count it, resume reading, start a request queued behind it), with the keep-alive
        expiry kept by one self-renewing timer."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self._idle_since is None:
            return  # busy: the next answer arms it again
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self._idle_timer = self.loop.call_later(left, self._idle_check)
        else:
            self.timeout_keep_alive_handler()

    def shutdown(self) -> None:
        # The server calls this on every connection when its graceful shutdown begins:
        # long-polls then answer at once rather than being cancelled at the grace's end.
        begin_draining()
        super().shutdown()

    def _refuse(self) -> None:
        body = orjson.dumps(headers_too_large(self._limit - HEAD_SLACK_BYTES).body())
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        # Closing with the client's bytes unread would reset the connection and could
        # destroy the answer before it is read: end our side, drop what still comes, and
        # close for good once the client has gone or after a short linger.
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def run(settings: ControlPlaneSettings, log_level: str, workers: int) -> None:
    """Serve until SIGTERM/SIGINT (blocking). With `workers` > 1 each worker process builds
    its own app from the TETHER_* environment."""
    from controlplane.app import create_app

    CappedHttpTools.limit_bytes = settings.max_header_bytes + HEAD_SLACK_BYTES
    uvicorn.run(
        "controlplane.app:create_app" if workers > 1 else create_app(settings),
        factory=workers > 1,
        workers=workers,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        # Longer than clients' idle expiry (httpx: 5 s), so a client never sends a request
        # on a connection the server is closing at that very moment.
        timeout_keep_alive=65,
        # Long-polls and streams may stay open for minutes; on SIGTERM they get this long
        # to finish, then they are cancelled and the process exits.
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
        loop="uvloop",
        http=CappedHttpTools,
        # Nothing here reads the client address; parsing X-Forwarded-For costs every request.
        proxy_headers=False,
    )
