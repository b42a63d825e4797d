"""The hot routes answered without FastAPI's per-request machinery.

Owns the fast lane for the router's three generate routes and the engine heartbeat: they
are matched by method and path before FastAPI sees the request (`ControlPlaneApp`, or
the served process's own exchange, `hot_exchange.py`, before any ASGI cycle) and served
under the same body limit and request metrics, with the same roles, validation, error
shape and metrics labels as the FastAPI routes of the same paths, which stay declared for
OpenAPI and /docs and call the same code (`Proxy.handle`, `Heartbeats.answer`).
Everything else goes to FastAPI. Never does database work on the generate path.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.auth import CALLERS, ENGINE
from controlplane.errors import ApiError, InternalError, InvalidRequest, error_response, field_path
from controlplane.middleware import BodyLimit, RequestMetrics
from controlplane.outage import DATABASE_ERRORS, is_database_down
from wire import Heartbeat, Role

if TYPE_CHECKING:
    from controlplane.services import Services

log = logging.getLogger(__name__)

GENERATE_ROUTES = {
    "/v1/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}
HEARTBEAT_PATH = re.compile(r"^/v1/engines/([^/]+)/heartbeat$")
JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class RouteTemplate:
    """Stands in for the FastAPI route in `scope["route"]`, for the request metrics."""

    path: str


HEARTBEAT_ROUTE = RouteTemplate("/v1/engines/{engine_id}/heartbeat")


def invalid_body(exc: ValidationError) -> InvalidRequest:
    """The same answer FastAPI's validation handler gives for a bad JSON body."""
    errors = exc.errors()
    problems = [
        {"field": field_path(("body", *e["loc"])), "message": str(e["msg"])} for e in errors
    ]
    first = problems[0]
    return InvalidRequest(
        f"{first['field']}: {first['message']}", field=first["field"], problems=problems
    )


def parse_heartbeat(raw: bytes) -> Heartbeat:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"body: not valid JSON ({exc})", field="body") from exc
    try:
        return Heartbeat.model_validate(body)
    except ValidationError as exc:
        raise invalid_body(exc) from exc


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


@dataclass(frozen=True)
class HotRoute:
    """One hot request's route: its template (for the metrics), who may call it, the
    handler and the handler's argument (the generate kind or the engine id)."""

    template: RouteTemplate
    allowed: frozenset[Role]
    handler: Callable[[bytes, dict[str, str], str, Role], Awaitable[Response]]
    arg: str


class HotPath:
    """ASGI app for the hot routes: `claim` says whether a request is one of them.

    `respond` is the lane's whole answer (auth, body, handler, the one error shape); the
    ASGI entry and the server's own exchange (`controlplane/hot_exchange.py`) both use it.
    """

    def __init__(self, cp: Services) -> None:
        self.cp = cp
        self.generate_routes = {
            path: HotRoute(RouteTemplate(path), CALLERS, self._generate, kind)
            for path, kind in GENERATE_ROUTES.items()
        }

    def match(self, method: str, path: str) -> HotRoute | None:
        """The hot route of a request, or None for a request FastAPI serves."""
        if method != "POST":
            return None
        route = self.generate_routes.get(path)
        if route is not None:
            return route
        found = HEARTBEAT_PATH.match(path)
        if found is not None:
            return HotRoute(HEARTBEAT_ROUTE, ENGINE, self._heartbeat, found.group(1))
        return None

    def claim(self, scope: Scope) -> bool:
        """Mark a hot request's scope with its route; False for all others."""
        if scope["type"] != "http":
            return False
        route = self.match(scope["method"], scope["path"])
        if route is None:
            return False
        scope["route"] = route.template
        scope["tether.hot"] = route
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Lower-case names; a repeated header keeps its last value (none of ours repeat).
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        response = await self.respond(
            scope["tether.hot"], scope["path"], headers, partial(read_body, receive)
        )
        await response(scope, receive, send)

    async def respond(
        self,
        route: HotRoute,
        path: str,
        headers: dict[str, str],
        body: Callable[[], Awaitable[bytes]],
    ) -> Response:
        """The answer to a hot request: its caller's role is checked before `body` is read."""
        try:
            found = await self.cp.tokens.role_of(headers.get("authorization"))
            role = self.cp.tokens.check(found, route.allowed)
            raw = await body()
            return await route.handler(raw, headers, route.arg, role)
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnect:
            # Nobody is left to answer; the status is for the request metrics only.
            return Response(status_code=499)
        except DATABASE_ERRORS as exc:
            if not is_database_down(exc):
                log.exception("POST %s failed", path)
                raise
            return error_response(self.cp.outage.failed(exc, path))
        except Exception:
            # FastAPI's error middleware is not above this lane: answer in the one shape.
            log.exception("POST %s failed", path)
            return error_response(InternalError("internal error; see the server log"))

    async def _generate(
        self, raw: bytes, headers: dict[str, str], kind: str, _role: Role
    ) -> Response:
        assert self.cp.proxy is not None
        return await self.cp.proxy.handle(kind, raw, headers)

    async def _heartbeat(
        self, raw: bytes, headers: dict[str, str], engine_id: str, role: Role
    ) -> Response:
        owner = self.cp.tokens.owner_key(headers.get("authorization"), role)
        reply = await self.cp.heartbeats.answer(engine_id, parse_heartbeat(raw), owner)
        return Response(reply, media_type="application/json")


@dataclass(frozen=True)
class HotLane:
    """The hot lane as the server sees it: the routes, their ASGI entry (`path` wrapped in
    the middleware both lanes share) and that middleware's limits and request counter,
    which the server's own exchange applies without going through ASGI."""

    path: HotPath
    asgi: ASGIApp
    limits: BodyLimit
    metrics: RequestMetrics
    # False: every hot request takes the ASGI entry (TETHER_HOT_EXCHANGE=0).
    exchange: bool = True


class ControlPlaneApp(FastAPI):
    """FastAPI with the hot lane in front: hot requests never enter FastAPI's middleware
    stack, routing or dependency injection (about a tenth of a generate request's CPU).
    Under `tether controlplane serve` most never enter ASGI either (`hot_exchange.py`)."""

    hot_lane: HotLane | None = None

    def install_hot_lane(self, lane: HotLane) -> None:
        self.hot_lane = lane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hot_lane is not None and self.hot_lane.path.claim(scope):
            await self.hot_lane.asgi(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
