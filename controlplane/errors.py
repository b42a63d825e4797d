"""The control plane's errors and their single JSON shape.

Each error class names its recovery (retry or fix the request) and maps to exactly one
HTTP status. Handlers here turn them, FastAPI's validation errors and stray HTTP errors into
`{"error": {"type", "message", "retryable", ...}}`. Nothing here touches the database.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from wire import ErrorBody

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in {
        401: "missing or unknown bearer token",
        403: "the token's role may not call this route",
        404: "unknown run, engine or version",
        409: "conflict; WeightVersionNotReady is retryable (see Retry-After)",
        413: "request body over the configured limit",
        422: "invalid request; `field` names the offending field",
    }.items()
}


class ApiError(Exception):
    """An error the HTTP layer answers with `status` and the shared error body."""

    status = 400
    retryable = False

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra
        self.headers: dict[str, str] = {}

    @property
    def type(self) -> str:
        return type(self).__name__

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "type": self.type,
                "message": self.message,
                "retryable": self.retryable,
                **self.extra,
            }
        }


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class EngineUnknown(NotFound):
    """The engine id is unknown or its lease lapsed: the agent should register again."""


class RunUnknown(NotFound):
    pass


class NoVersionYet(NotFound):
    pass


class RunExists(ApiError):
    status = 409


class VersionNotAtPointer(ApiError):
    """The trainer announced a version the store's pointer does not (yet) name."""

    status = 409


class InvalidRequest(ApiError):
    status = 422


class BodyTooLarge(ApiError):
    status = 413


class WeightVersionNotReady(ApiError):
    """No engine serves an acceptable version right now; retry after `Retry-After`."""

    status = 409
    retryable = True

    def __init__(self, message: str, retry_after_s: float, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.headers = {"Retry-After": str(max(1, round(retry_after_s)))}


class NoEngineAvailable(ApiError):
    """Engines fit but none answered (connection refused, 5xx); retry shortly."""

    status = 503
    retryable = True

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.headers = {"Retry-After": "1"}


class InternalError(ApiError):
    """A bug or an unexpected failure on the server; the log has the traceback."""

    status = 500
    retryable = True


def error_response(error: ApiError) -> Response:
    return Response(
        json.dumps(error.body()),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json",
    )


def field_path(loc: Sequence[Any]) -> str:
    """`("body", "weight_version", "min_version")` → `body.weight_version.min_version`."""
    return ".".join(str(part) for part in loc)


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_validation(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = field_path(first.get("loc", ()))
        problems = [
            {"field": field_path(e.get("loc", ())), "message": str(e.get("msg", ""))}
            for e in errors
        ]
        return error_response(
            InvalidRequest(
                f"{field or 'request'}: {first.get('msg', 'invalid')}",
                field=field,
                problems=problems,
            )
        )

    async def on_http(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        names = {404: "NotFound", 405: "MethodNotAllowed", 413: "BodyTooLarge"}
        body = {
            "error": {
                "type": names.get(exc.status_code, "HTTPError"),
                "message": str(exc.detail),
                "retryable": False,
            }
        }
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
