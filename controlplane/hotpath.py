"""The hot routes answered without FastAPI's per-request machinery.

Owns the fast lane for the router's three generate routes and the engine heartbeat: they
are matched by method and path here and served straight from ASGI, with the same roles,
validation, error shape and metrics labels as the FastAPI routes of the same paths, which
stay declared for OpenAPI and /docs and call the same code (`Proxy.handle`,
`Heartbeats.answer`). Everything else passes through to FastAPI. Never does database work
on the generate path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.errors import ApiError, InvalidRequest, error_response, field_path
from controlplane.schema import Heartbeat, Role

if TYPE_CHECKING:
    from controlplane.app import ControlPlane

CALLERS = frozenset({Role.CLIENT, Role.TRAINER})
ENGINE = frozenset({Role.ENGINE})
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


class HotPath:
    """ASGI middleware: serves the hot routes itself, passes every other request on."""

    def __init__(self, app: ASGIApp, cp: ControlPlane) -> None:
        self.app = app
        self.cp = cp
        self.generate_routes = {path: RouteTemplate(path) for path in GENERATE_ROUTES}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        kind = GENERATE_ROUTES.get(path)
        if kind is not None:
            scope["route"] = self.generate_routes[path]
            await self._serve(scope, receive, send, CALLERS, self._generate, kind)
            return
        match = HEARTBEAT_PATH.match(path)
        if match is not None:
            scope["route"] = HEARTBEAT_ROUTE
            await self._serve(scope, receive, send, ENGINE, self._heartbeat, match.group(1))
            return
        await self.app(scope, receive, send)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, allowed: Any, handler: Any, arg: str
    ) -> None:
        headers = Headers(scope=scope)
        try:
            role = await self.cp.tokens.role_of(headers.get("authorization"))
            self.cp.tokens.check(role, allowed)
            raw = await read_body(receive)
            response = await handler(raw, headers, arg)
        except ApiError as exc:
            response = error_response(exc)
        except ClientDisconnect:
            # Nobody is left to answer; the status is for the request metrics only.
            response = Response(status_code=499)
        await response(scope, receive, send)

    async def _generate(self, raw: bytes, headers: Headers, kind: str) -> Response:
        assert self.cp.proxy is not None
        return await self.cp.proxy.handle(kind, raw, headers)

    async def _heartbeat(self, raw: bytes, _headers: Headers, engine_id: str) -> Response:
        reply = await self.cp.heartbeats.answer(engine_id, parse_heartbeat(raw))
        return Response(reply, media_type="application/json")
