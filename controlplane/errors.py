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
        404: "unknown run, engine, version or session",
        409: "conflict: WeightVersionNotReady is retryable (see Retry-After); "
        "WeightVersionUnavailable and PrecisionNotServed are not",
        410: "the session ended or expired",
        413: "request body over the configured limit",
        422: "invalid request; `field` names the offending field",
        431: "request headers over the configured limit",
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


class SessionUnknown(NotFound):
    """No such session (or not this caller's): create one with POST /v1/sessions."""


class SessionGone(ApiError):
    """The session ended (DELETE) or expired: start a new one."""

    status = 410


class SessionBusy(ApiError):
    """Another turn of the session is in progress: send a session's turns one at a time."""

    status = 409
    retryable = True


class SessionHistoryMismatch(ApiError):
    """The request's messages do not repeat the session's recorded turns (`field` names the
    first that differs): send the conversation exactly as it was answered."""

    status = 422


class EngineNotOwned(Forbidden):
    """The engine was registered with another credential; only that one (or an admin
    token) may heartbeat as it, change it or deregister it."""


class EngineUrlTaken(ApiError):
    """Another credential holds a live registration for this engine URL."""

    status = 409


class RunExists(ApiError):
    status = 409


class VersionNotAtPointer(ApiError):
    """The trainer announced a version the store's pointer does not (yet) name."""

    status = 409


class InvalidRequest(ApiError):
    status = 422


class VersionTooFarAhead(InvalidRequest):
    """The requested version is further above the run's latest than any plausible wait."""


class StoreUrlRefused(InvalidRequest):
    """A run's store URL is outside the configured store roots."""


class InvalidJson(InvalidRequest):
    """The body is not JSON the control plane will read (encoding, nesting, numbers)."""


class BodyTooLarge(ApiError):
    status = 413


class HeadersTooLarge(ApiError):
    status = 431


class WeightVersionNotReady(ApiError):
    """No engine serves an acceptable version right now; retry after `Retry-After`."""

    status = 409
    retryable = True

    def __init__(self, message: str, retry_after_s: float, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.headers = {"Retry-After": str(max(1, round(retry_after_s)))}


class WeightVersionUnavailable(ApiError):
    """No engine serves the version and none will: it is older than what the run's policy
    keeps serviceable, or the store deleted it. Waiting does not help; ask for
    `nearest_servable_version` (or a `min_version`) instead."""

    status = 409


class PrecisionNotServed(ApiError):
    """The run has engines, none of them of the requested precision(s): widen `precision`
    or register an engine of that precision."""

    status = 409


class NoEngineAvailable(ApiError):
    """Engines fit but none answered (connection refused, 5xx); retry shortly."""

    status = 503
    retryable = True

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.headers = {"Retry-After": "1"}


class DatabaseUnavailable(ApiError):
    """The control plane's database does not answer; retry after `Retry-After`."""

    status = 503
    retryable = True

    def __init__(self, message: str, retry_after_s: float, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.headers = {"Retry-After": str(max(1, round(retry_after_s)))}


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


def unreadable_body(exc: StarletteHTTPException) -> InvalidJson | None:
    """FastAPI answers a body its JSON decoder chokes on with a bare 400 ("There was an
    error parsing the body"); name the problem instead, from the exception behind it."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        problem = f"not valid UTF-8 (byte {cause.start}); send JSON encoded as UTF-8"
    elif isinstance(cause, RecursionError):
        problem = "JSON nested too deeply; flatten the document"
    elif isinstance(cause, ValueError):
        problem = f"not readable as JSON ({cause}); numbers must fit the field they fill"
    else:
        return None
    return InvalidJson(f"body: {problem}", field="body")


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
        unreadable = unreadable_body(exc)
        if unreadable is not None:
            return error_response(unreadable)
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
