"""The hot routes answered without FastAPI's per-request machinery.

Owns the fast lane for the router's three generate routes, the engine heartbeat and the
engine's target long-poll: they are matched by method and path before FastAPI sees the
request (`ControlPlaneApp`, or the served process's own exchange, `hot_exchange.py`,
before any ASGI cycle) and served under the same body limit and
request metrics, with the same roles, validation, error shape and metrics labels as the
FastAPI routes of the same paths, which stay declared for OpenAPI and /docs and call the
same code (`Proxy.handle`, `Heartbeats.answer`, `long_poll.wait_for_target`). Everything
else goes to FastAPI. Never does database work on the generate path.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

import orjson
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.auth import CALLERS, ENGINE
from controlplane.errors import ApiError, InternalError, InvalidRequest, error_response, field_path
from controlplane.long_poll import wait_for_target
from controlplane.middleware import BodyLimit, RequestMetrics
from controlplane.outage import DATABASE_ERRORS, is_database_down
from wire import MAX_INT, Heartbeat, Role

if TYPE_CHECKING:
    from controlplane.services import Services

log = logging.getLogger(__name__)

GENERATE_ROUTES = {
    "/v1/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}
HEARTBEAT_PATH = re.compile(r"^/v1/engines/([^/]+)/heartbeat$")
TARGET_PATH = re.compile(r"^/v1/engines/([^/]+)/target$")
JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class RouteTemplate:
    """Stands in for the FastAPI route in `scope["route"]`, for the request metrics."""

    path: str


HEARTBEAT_ROUTE = RouteTemplate("/v1/engines/{engine_id}/heartbeat")
TARGET_ROUTE = RouteTemplate("/v1/engines/{engine_id}/target")


class TargetQuery(BaseModel):
    """The target long-poll's query, with the bounds of the FastAPI route's `Query`s."""

    model_config = ConfigDict(extra="ignore")

    after: int | None = Field(default=None, ge=0, le=MAX_INT)
    timeout: float = Field(default=30.0, ge=0)


def invalid_body(exc: ValidationError, where: str = "body") -> InvalidRequest:
    """The same answer FastAPI's validation handler gives for a bad JSON body (or, with
    `where="query"`, bad query parameters)."""
    errors = exc.errors()
    problems = [{"field": field_path((where, *e["loc"])), "message": str(e["msg"])} for e in errors]
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
    handler: Callable[[bytes, dict[str, str], str, Role, bytes], Awaitable[Response]]
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
        if method == "GET":
            found = TARGET_PATH.match(path)
            if found is None:
                return None
            return HotRoute(TARGET_ROUTE, ENGINE, self._target, found.group(1))
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
            scope["tether.hot"],
            scope["path"],
            headers,
            partial(read_body, receive),
            scope.get("query_string", b""),
        )
        await response(scope, receive, send)

    async def respond(
        self,
        route: HotRoute,
        path: str,
        headers: dict[str, str],
        body: Callable[[], Awaitable[bytes]],
        query: bytes = b"",
    ) -> Response:
        """The answer to a hot request: its caller's role is checked before `body` is read."""
        try:
            found = await self.cp.tokens.role_of(headers.get("authorization"))
            role = self.cp.tokens.check(found, route.allowed)
            raw = await body()
            return await route.handler(raw, headers, route.arg, role, query)
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnect:
            # Nobody is left to answer; the status is for the request metrics only.
            return Response(status_code=499)
        except DATABASE_ERRORS as exc:
            if not is_database_down(exc):
                log.exception("%s failed", path)
                raise
            return error_response(self.cp.outage.failed(exc, path))
        except Exception:
            # FastAPI's error middleware is not above this lane: answer in the one shape.
            log.exception("%s failed", path)
            return error_response(InternalError("internal error; see the server log"))

    async def _generate(
        self, raw: bytes, headers: dict[str, str], kind: str, _role: Role, _query: bytes
    ) -> Response:
        assert self.cp.proxy is not None
        return await self.cp.proxy.handle(kind, raw, headers)

    async def _heartbeat(
        self, raw: bytes, headers: dict[str, str], engine_id: str, role: Role, _query: bytes
    ) -> Response:
        owner = self.cp.tokens.owner_key(headers.get("authorization"), role)
        reply = await self.cp.heartbeats.answer(engine_id, parse_heartbeat(raw), owner)
        return Response(reply, media_type="application/json")

    async def _target(
        self, _raw: bytes, _headers: dict[str, str], engine_id: str, _role: Role, query: bytes
    ) -> Response:
        # The last of a repeated parameter, as FastAPI takes it.
        params = dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True))
        try:
            asked = TargetQuery.model_validate(params)
        except ValidationError as exc:
            raise invalid_body(exc, "query") from exc
        reply = await wait_for_target(self.cp, engine_id, asked.after, asked.timeout)
        return Response(reply.model_dump_json(), media_type="application/json")


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
