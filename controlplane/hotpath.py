"""The hot routes answered without FastAPI's per-request machinery.

Owns the fast lane for the router's three generate routes and the engine heartbeat: they
are matched by method and path before FastAPI sees the request (`ControlPlaneApp`) and
served straight from ASGI under the same body limit and request metrics, with the same
roles, validation, error shape and metrics labels as the FastAPI routes of the same paths,
which stay declared for OpenAPI and /docs and call the same code (`Proxy.handle`,
`Heartbeats.answer`). Everything else goes to FastAPI. Never does database work on the
generate path.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.auth import CALLERS, ENGINE
from controlplane.errors import ApiError, InternalError, InvalidRequest, error_response, field_path
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


class HotPath:
    """ASGI app for the hot routes: `claim` says whether a request is one of them."""

    def __init__(self, cp: Services) -> None:
        self.cp = cp
        self.generate_routes = {path: RouteTemplate(path) for path in GENERATE_ROUTES}

    def claim(self, scope: Scope) -> bool:
        """Mark a hot request's scope with its route and handler; False for all others."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return False
        path = scope["path"]
        kind = GENERATE_ROUTES.get(path)
        if kind is not None:
            scope["route"] = self.generate_routes[path]
            scope["tether.hot"] = (CALLERS, self._generate, kind)
            return True
        match = HEARTBEAT_PATH.match(path)
        if match is not None:
            scope["route"] = HEARTBEAT_ROUTE
            scope["tether.hot"] = (ENGINE, self._heartbeat, match.group(1))
            return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        allowed, handler, arg = scope["tether.hot"]
        # Lower-case names; a repeated header keeps its last value (none of ours repeat).
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            found = await self.cp.tokens.role_of(headers.get("authorization"))
            role = self.cp.tokens.check(found, allowed)
            raw = await read_body(receive)
            response = await handler(raw, headers, arg, role)
        except ApiError as exc:
            response = error_response(exc)
        except ClientDisconnect:
            # Nobody is left to answer; the status is for the request metrics only.
            response = Response(status_code=499)
        except DATABASE_ERRORS as exc:
            if not is_database_down(exc):
                log.exception("%s %s failed", scope["method"], scope["path"])
                raise
            response = error_response(self.cp.outage.failed(exc, scope["path"]))
        except Exception:
            # FastAPI's error middleware is not above this lane: answer in the one shape.
            log.exception("%s %s failed", scope["method"], scope["path"])
            response = error_response(InternalError("internal error; see the server log"))
        await response(scope, receive, send)

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


class ControlPlaneApp(FastAPI):
    """FastAPI with the hot lane in front: hot requests never enter FastAPI's middleware
    stack, routing or dependency injection (about a tenth of a generate request's CPU)."""

    _hot: tuple[HotPath, ASGIApp] | None = None

    def install_hot_lane(self, hot_path: HotPath, lane: ASGIApp) -> None:
        """`lane` is `hot_path` wrapped in the middleware both lanes share."""
        self._hot = (hot_path, lane)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._hot is not None and self._hot[0].claim(scope):
            await self._hot[1](scope, receive, send)
            return
        await super().__call__(scope, receive, send)
