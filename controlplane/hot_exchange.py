"""The hot lane's own HTTP exchange: a hot request answered on the server's connection
without ASGI.

Owns serving one request of the hot lane (`HotPath`: the generate routes, the heartbeat
and the target long-poll) straight from uvicorn's httptools protocol: the body is
collected from the parser's callbacks, `HotPath.respond` answers it (the same roles,
validation, error shape and handlers as the ASGI entry), and a complete answer leaves in
one write — status line,
headers and body — instead of the ASGI cycle's scope, receive/send messages, middleware
closures and two writes. The body and header limits and the request metrics are the
lane's own middleware objects, applied directly. Streamed answers go through small ASGI
send/receive shims with chunked framing and the connection's write flow control.

A generate request with a cached token, an admitted body and an idle kept connection to
its engine runs without a task: sent from the body's last parser callback, answered from
the engine connection's (see "The routed request without a task" below).

It stands in the protocol's `cycle` slot and keeps the attributes the protocol reads and
writes there (`body`, `more_body`, `message_event`, `response_complete`, `disconnected`,
`keep_alive`), so pipelining behind it, disconnects and graceful shutdown are uvicorn's
own; the end of an answer goes to the protocol's `on_complete` (its keep-alive expiry).
Never takes a request that is not a plain HTTP/1.1 POST (or the target long-poll's GET) on
a hot path with nothing still unanswered ahead of it on the connection (no `Expect`, no
upgrade, no percent-encoded path, no concurrency limit configured): those go to uvicorn's
ASGI cycle and reach the same `HotPath` through `ControlPlaneApp`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any

import httptools
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Message
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from controlplane.errors import ApiError, InternalError, error_response
from controlplane.hotpath import GENERATE_ROUTES, HotLane, HotRoute
from controlplane.proxy import Forward
from controlplane.snapshot import EngineView
from http1.client import Answer, UpstreamError

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

CLIENT_GONE = 499
# The methods of the hot routes (`HotPath.match`): the POSTs, and the target long-poll's GET.
HOT_METHODS = (b"POST", b"GET")


def start(protocol: HttpToolsProtocol, on_complete: Callable[[], None]) -> bool:
    """Take the request whose head the protocol has just parsed, if it is a hot one that
    this exchange may serve; False leaves it to uvicorn's ASGI cycle. `on_complete` is the
    protocol's own end of a response (keep-alive expiry, a pipelined request next)."""
    lane = getattr(protocol.app, "hot_lane", None)
    if not isinstance(lane, HotLane) or not lane.exchange:
        return False
    parser = protocol.parser
    current = protocol.cycle
    method = parser.get_method()
    if (
        method not in HOT_METHODS
        or parser.get_http_version() != "1.1"
        or parser.should_upgrade()
        or protocol.expect_100_continue
        or protocol.limit_concurrency is not None
        # An answer still due ahead of this one: uvicorn's queue keeps them in order.
        or (current is not None and not current.response_complete)
    ):
        return False
    url = httptools.parse_url(protocol.url)
    raw_path = url.path
    if b"%" in raw_path:
        return False
    path = raw_path.decode("ascii")
    route = lane.path.match(method.decode("ascii"), path)
    if route is None:
        return False
    exchange = HotExchange(
        protocol, lane, route, path, url.query or b"", parser.should_keep_alive(), on_complete
    )
    protocol.cycle = exchange  # type: ignore[assignment]
    if route.template.path in GENERATE_ROUTES and lane.path.cp.proxy is not None:
        exchange.awaiting_body = True  # a generate request: see `body_complete`
    else:
        exchange.run_in_task(exchange.run())
    return True


class Wakeup:
    """The protocol's `message_event` for an exchange: asyncio.Event's `set`, `clear`,
    `is_set` and `wait`, with the event itself made only once something waits. A request
    routed without a task is never waited on; the protocol still sets this twice."""

    __slots__ = ("_event", "_flag")

    def __init__(self) -> None:
        self._flag = False
        self._event: asyncio.Event | None = None

    def set(self) -> None:
        self._flag = True
        if self._event is not None:
            self._event.set()

    def clear(self) -> None:
        self._flag = False
        if self._event is not None:
            self._event.clear()

    def is_set(self) -> bool:
        return self._flag

    async def wait(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
            if self._flag:
                self._event.set()
        await self._event.wait()


class HotExchange:
    """One hot request and its answer on one connection."""

    def __init__(
        self,
        protocol: HttpToolsProtocol,
        lane: HotLane,
        route: HotRoute,
        path: str,
        query: bytes,
        keep_alive: bool,
        on_complete: Callable[[], None],
    ) -> None:
        self.protocol = protocol
        self.on_complete = on_complete
        self.lane = lane
        self.route = route
        self.path = path
        self.query = query
        self.raw_headers = protocol.headers
        # The protocol's view of its current request (see the module docstring).
        self.body = bytearray()
        self.more_body = True
        self.message_event = Wakeup()
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = keep_alive
        self._chunked = False
        # A generate request waits for its whole body before anything runs; then, when
        # nothing unusual is asked, it is routed without a task (`body_complete`).
        self.awaiting_body = False
        self._forward: Forward | None = None

    def run_in_task(self, work: Coroutine[Any, Any, None]) -> None:
        protocol = self.protocol
        task = protocol.loop.create_task(work)
        protocol.tasks.add(task)
        task.add_done_callback(protocol.tasks.discard)

    # The routed request without a task ------------------------------------------------
    #
    # Most generate requests are small, carry a token whose role is cached, and go to an
    # engine with an idle keep-alive connection in the pool. Those are answered from the
    # protocols' own callbacks: the body completes -> the engine is chosen and the request
    # written; the engine's answer completes -> the client's answer written. No task, no
    # coroutine chain, no extra event-loop pass per step. Anything else (a refusal, a
    # token to look up, a stream, a run the snapshot has not seen, a body past the
    # protocol's buffer, an engine to connect to) goes through `run` and
    # `HotPath.respond`, the same code as before, and is answered exactly as it would be
    # there; until an engine is chosen the fast path has changed nothing it would see.

    def body_past_buffer(self) -> None:
        """The protocol stopped reading a large body: only `run` resumes reading it."""
        if self.awaiting_body:
            self.awaiting_body = False
            self.run_in_task(self.run())

    def gone_before_body(self) -> None:
        """The client left before its body was complete: counted as `run` counts it."""
        if self.awaiting_body:
            self.awaiting_body = False
            self.lane.metrics.count(self.route.template.path, CLIENT_GONE)
            self._complete()

    def body_complete(self) -> None:
        if not self.awaiting_body:
            return
        self.awaiting_body = False
        try:
            forward = self._admitted()
        except Exception:
            forward = None
        if forward is None:
            self.run_in_task(self.run())
            return
        self._forward = forward
        self._dispatch()

    def _admitted(self) -> Forward | None:
        """The request, checked and admitted, if it needs nothing but the snapshot."""
        lane = self.lane
        cp = lane.path.cp
        proxy = cp.proxy
        if proxy is None or lane.limits.refuse_head(self.raw_headers) is not None:
            return None
        if len(self.body) > lane.limits.limit:
            return None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.raw_headers}
        hit, role = cp.tokens.cached(cp.tokens.digest(headers.get("authorization")))
        if not hit or role is None:
            return None
        cp.tokens.check(role, self.route.allowed)
        forward = proxy.begin(self.route.arg, bytes(self.body), headers)
        if forward.fields.stream or not forward.known_run:
            return None
        proxy.admit(forward)
        return forward

    def _dispatch(self) -> None:
        """Send to the next engine, or answer the refusal when none is left."""
        forward = self._forward
        proxy = self.lane.path.cp.proxy
        assert forward is not None and proxy is not None
        try:
            while True:
                engine = proxy.next_engine(forward)
                if engine is None:
                    self._finish(error_response(proxy.give_up(forward)))
                    return
                chosen = engine
                try:
                    sent = proxy.client.post_now(
                        chosen.url,
                        forward.path,
                        forward.raw,
                        forward.extra,
                        partial(self._engine_answered, chosen),
                    )
                except Exception as exc:
                    proxy.failed(forward, chosen, exc)
                    continue
                if not sent:
                    self.run_in_task(self._forward_in_task(chosen))
                return
        except Exception:
            log.exception("POST %s failed", self.path)
            self._finish(error_response(InternalError("internal error; see the server log")))

    def _engine_answered(self, engine: EngineView, outcome: Answer | UpstreamError) -> None:
        forward = self._forward
        proxy = self.lane.path.cp.proxy
        assert forward is not None and proxy is not None
        try:
            if isinstance(outcome, UpstreamError):
                proxy.failed(forward, engine, outcome)
                response = None
            else:
                try:
                    response = proxy.settle(forward, engine, outcome)
                except Exception as exc:
                    proxy.failed(forward, engine, exc)
                    response = None
        except Exception:
            log.exception("POST %s failed", self.path)
            response = error_response(InternalError("internal error; see the server log"))
        if response is None:
            self._dispatch()
        else:
            self._finish(response)

    async def _forward_in_task(self, engine: EngineView) -> None:
        """The rest of the routing in a coroutine: this engine needs a new connection."""
        forward = self._forward
        proxy = self.lane.path.cp.proxy
        assert forward is not None and proxy is not None
        try:
            response = await proxy.forward(forward, engine)
        except ApiError as exc:
            response = error_response(exc)
        except Exception:
            log.exception("POST %s failed", self.path)
            response = error_response(InternalError("internal error; see the server log"))
        self._finish(response)

    def _finish(self, response: Response) -> None:
        """Write a complete answer, count it and end the exchange, as `run` does."""
        status = response.status_code
        try:
            if not self.disconnected:
                self._write_whole(response)
        except Exception:
            log.exception("POST %s: the answer could not be sent", self.path)
            self.keep_alive = False
        finally:
            self.lane.metrics.count(self.route.template.path, status)
            self._complete()

    # The task ---------------------------------------------------------------------------

    async def run(self) -> None:
        status = 500
        try:
            response = await self._answer()
            status = response.status_code
            if status != CLIENT_GONE and not self.disconnected:
                await self._send_response(response)
        except Exception:
            # `respond` answers every error in the one shape; this is a failure to send.
            log.exception("%s: the answer could not be sent", self.path)
            self.keep_alive = False
        except asyncio.CancelledError:
            self.keep_alive = False  # shutting down mid-answer: end the connection
            raise
        finally:
            self.lane.metrics.count(self.route.template.path, status)
            self._complete()

    async def _answer(self) -> Response:
        refused = self.lane.limits.refuse_head(self.raw_headers)
        if refused is not None:
            return error_response(refused)
        # Names are lower-case already (the protocol lowers them); a repeated header keeps
        # its last value, as on the ASGI entry.
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.raw_headers}
        try:
            return await self.lane.path.respond(
                self.route, self.path, headers, self._read_body, self.query
            )
        except Exception:
            # `respond` logged it and re-raised for ASGI's server; answer in the one shape.
            return error_response(InternalError("internal error; see the server log"))

    async def _read_body(self) -> bytes:
        limit = self.lane.limits.limit
        while self.more_body and not self.disconnected:
            if len(self.body) > limit:
                raise self.lane.limits.too_large()
            self.protocol.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected:
            raise ClientDisconnect()
        if len(self.body) > limit:
            raise self.lane.limits.too_large()
        return bytes(self.body)

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> list[bytes]:
        parts = [STATUS_LINE[status]]
        for name, value in (*self.protocol.server_state.default_headers, *headers):
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        return parts

    async def _send_response(self, response: Response) -> None:
        if isinstance(response, StreamingResponse) or not hasattr(response, "body"):
            await response({"type": "http", "method": "POST"}, self._receive, self._send)
            return
        self._write_whole(response)

    def _write_whole(self, response: Response) -> None:
        parts = self._head(response.status_code, response.raw_headers)
        parts += (b"\r\n", bytes(response.body))
        self.protocol.transport.write(b"".join(parts))

    async def _send(self, message: Message) -> None:
        """ASGI `send` for a streamed answer: chunked framing, paced by the socket."""
        flow = self.protocol.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()
        if self.disconnected:
            return
        transport = self.protocol.transport
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            self._chunked = not any(name == b"content-length" for name, _ in headers)
            parts = self._head(message["status"], headers)
            if self._chunked:
                parts.append(b"transfer-encoding: chunked\r\n")
            parts.append(b"\r\n")
            transport.write(b"".join(parts))
            return
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if not self._chunked:
            transport.write(body)
            return
        framed = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
        if not more:
            framed.append(b"0\r\n\r\n")
        transport.write(b"".join(framed))

    async def _receive(self) -> dict[str, Any]:
        """ASGI `receive` after the body was read: returns once the client has left."""
        while not self.disconnected:
            await self.message_event.wait()
            self.message_event.clear()
        return {"type": "http.disconnect"}

    def _complete(self) -> None:
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive or self.disconnected:
            self.protocol.transport.close()
        self.on_complete()
