"""ASGI middleware of the control plane: request size limits and request metrics.

Owns refusing oversized requests in the shared error shape: headers over the limit (431;
the server's HTTP parser is capped too, see `controlplane/serving.py`) and bodies over the
limit (413, checked on Content-Length and again while a chunked body streams in, whichever
lane or route reads it), and counting requests by route template and status. Pure ASGI
so the hot path pays no extra task or buffering.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.errors import ApiError, BodyTooLarge, HeadersTooLarge, error_response
from controlplane.metrics import Metrics


def _over(error: type[ApiError], what: str, setting: str, field: str, limit: int) -> ApiError:
    return error(
        f"request {what} larger than the limit of {limit} bytes: shorten it "
        f"(raise {setting} if this is expected)",
        field=field,
        limit=limit,
    )


def _too_large(limit: int) -> ApiError:
    return _over(BodyTooLarge, "body is", "TETHER_MAX_BODY_BYTES", "body", limit)


def headers_too_large(limit: int) -> ApiError:
    return _over(HeadersTooLarge, "headers are", "TETHER_MAX_HEADER_BYTES", "headers", limit)


class BodyLimit:
    """413 for a body over `limit`, 431 for headers over `header_limit` bytes in all."""

    def __init__(self, app: ASGIApp, limit: int, header_limit: int = 64 * 1024) -> None:
        self.app = app
        self.limit = limit
        self.header_limit = header_limit

    def refuse_head(self, headers: list[tuple[bytes, bytes]]) -> ApiError | None:
        """The refusal a request head earns before its body is read (431 for headers over
        the limit, 413 for a declared length over it), or None."""
        header_bytes = 0
        declared = None
        for name, value in headers:
            header_bytes += len(name) + len(value) + 4
            if name == b"content-length":
                declared = value
        if header_bytes > self.header_limit:
            return headers_too_large(self.header_limit)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return _too_large(self.limit)
        return None

    def too_large(self) -> ApiError:
        """The refusal of a body that passed the limit while it streamed in (413)."""
        return _too_large(self.limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refuse_head(scope["headers"])
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            return
        seen = 0
        over = False
        answered = False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise _too_large(self.limit)
            return message

        async def guarded(message: Message) -> None:
            # FastAPI turns an exception raised while it reads the body into its own 400;
            # once the body passed the limit, the answer is the 413, whoever wrote another.
            nonlocal answered
            if over:
                if not answered:
                    answered = True
                    await error_response(_too_large(self.limit))(scope, receive, send)
                return
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except BodyTooLarge:
            if answered:
                raise
            answered = True
            await error_response(_too_large(self.limit))(scope, receive, send)


class RequestMetrics:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        # A loop tally (`LoopCounter`), keyed (route, status); bounded by routes x statuses.
        self._counts = metrics.requests.counts

    def count(self, template: str, status: int) -> None:
        """Count one answered request (also called by the hot lane's own exchange)."""
        self._counts[(template, status)] += 1

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
            self.count(template, status)
