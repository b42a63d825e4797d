"""ASGI middleware of the control plane: the request-body size limit and request metrics.

Owns refusing oversized bodies (413 in the shared error shape, checked on Content-Length
and again while streaming a chunked body) and counting requests by route template and
status. Pure ASGI so the hot path pays no extra task or buffering.
"""

from __future__ import annotations

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.errors import BodyTooLarge, error_response
from controlplane.metrics import Metrics


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(
        f"request body is larger than the limit of {limit} bytes "
        "(raise TETHER_MAX_BODY_BYTES if this is expected)",
        field="body",
        limit=limit,
    )


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.limit:
                    await error_response(_too_large(self.limit))(scope, receive, send)
                    return
                break
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _too_large(self.limit)
            return message

        await self.app(scope, counted, send)


class RequestMetrics:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        # The labelled child per (route, status): `labels()` validates and locks on every
        # call, a dict lookup does not. Bounded by routes x statuses.
        self._children: dict[tuple[str, int], Counter] = {}

    def _count(self, template: str, status: int) -> None:
        child = self._children.get((template, status))
        if child is None:
            child = self.metrics.requests.labels(template, str(status))
            self._children[(template, status)] = child
        child.inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self._count(template, status)
