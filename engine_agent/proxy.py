"""The versioned proxy in front of one engine: what clients and the router talk to.

Owns the agent's HTTP surface:

- `/generate`, `/v1/completions`, `/v1/chat/completions`: admitted through the
  `AdmissionGate`, Tether's fields (`weight_version`, `precision`, `session_id`, `run_id`)
  stripped, `extra_key` namespaced by the served version (the prefix cache never crosses
  versions), forwarded over one keep-alive `httpx.AsyncClient`, and answered with
  `weight_version_start` / `weight_version_end` at the top level of each JSON object (every
  SSE chunk too) plus the `X-Tether-Weight-Version-Start/End` headers (a stream only gets
  the start header: its end is in the last chunk). A client that goes away aborts the
  engine request by its `rid`. An unreachable engine → 503 with `Retry-After`.
- the engine's control routes answer 403: only the agent changes weights;
- `GET /health` (503 until the first catch-up and while the engine is in error),
  `GET /server_info` (applied version, sync state, staging, last error, pass timings),
  read-only `GET /model_info` and `GET /v1/models` passed through.

Must never change weights or decide versions; errors use the control plane's error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from engine_agent.gate import Admission, AdmissionGate, VersionNotReady
from engine_agent.status import AgentStatus
from store.types import VersionConstraint
from wire import (
    VERSION_END_HEADER,
    VERSION_START_HEADER,
    ErrorBody,
    ErrorDetail,
    Precision,
    RoutingFields,
    WeightVersionNotReadyDetail,
)

log = logging.getLogger(__name__)

TETHER_FIELDS = ("weight_version", "precision", "session_id", "run_id")
GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
READ_ONLY_PATHS = ("/model_info", "/get_model_info", "/v1/models")
# Every SGLang route that mutates weights, the cache or scheduling (sglang-api §5, §9).
CONTROL_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/update_weights_from_prepared",
        "/update_weights_from_cpu",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/abort_request",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pull_weights",
        "/stage_weight_update",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/load_lora_adapter_from_distributed",
        "/weights_checker",
    }
)
RETRY_AFTER_S = 1


def error_response(status: int, detail: ErrorDetail, retry_after: int | None = None) -> Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = ErrorBody(error=detail).model_dump(mode="json", exclude_none=True)
    return JSONResponse(body, status_code=status, headers=headers)


def namespace_key(version: int, client_key: Any) -> str:
    """The `extra_key` the engine sees: the served version first, the client's key after."""
    return f"tether-v{version}" + (f":{client_key}" if client_key else "")


def prepare_body(body: dict[str, Any], version: int) -> list[str]:
    """Strip Tether's fields, namespace `extra_key`, make sure there is a `rid`; return the
    rids to abort if the client leaves (SGLang's abort matches rid prefixes)."""
    for name in TETHER_FIELDS:
        body.pop(name, None)
    key = body.get("extra_key")
    if isinstance(key, list):
        body["extra_key"] = [namespace_key(version, k) for k in key]
    else:
        body["extra_key"] = namespace_key(version, key)
    rid = body.get("rid")
    if rid is None:
        rid = body["rid"] = f"tether-{uuid.uuid4().hex}"
    return [str(r) for r in rid] if isinstance(rid, list) else [str(rid)]


def _as_version(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def version_span(payload: dict[str, Any], captured: int) -> tuple[int, int]:
    """(first, last) weight version of one answer, from the engine's spans when present,
    else its `weight_version` label, else the version the gate captured."""
    meta = payload.get("meta_info") or payload.get("metadata") or {}
    spans = meta.get("weight_versions") or []
    if spans:
        start, end = _as_version(spans[0].get("version")), _as_version(spans[-1].get("version"))
    else:
        start = end = _as_version(meta.get("weight_version"))
    return (captured if start is None else start, captured if end is None else end)


def stamp(payload: Any, captured: int) -> tuple[int, int] | None:
    """Add `weight_version_start/end` to each JSON object; return the overall span."""
    objects = payload if isinstance(payload, list) else [payload]
    spans = []
    for item in objects:
        if not isinstance(item, dict) or "error" in item:
            continue
        start, end = version_span(item, captured)
        if start != captured:
            log.warning(
                "engine reports v%d for a request the gate admitted on v%d", start, captured
            )
        item["weight_version_start"], item["weight_version_end"] = start, end
        spans.append((start, end))
    if not spans:
        return None
    return min(s for s, _ in spans), max(e for _, e in spans)


class VersionedProxy:
    """Forwards generate requests to `engine_url` through `gate`; builds the app."""

    def __init__(
        self,
        *,
        engine_url: str,
        gate: AdmissionGate,
        status: AgentStatus,
        precision: Precision,
        run_id: str,
        server_info: Callable[[], dict[str, Any]],
        on_engine_error: Callable[[str], None] | None = None,
        timeout_s: float = 600.0,
        connections: int = 1024,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.gate = gate
        self.status = status
        self.precision = precision
        self.run_id = run_id
        self.server_info = server_info
        self.on_engine_error = on_engine_error
        self.client = httpx.AsyncClient(
            base_url=self.engine_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            # Every connection may stay alive: at high concurrency a smaller keep-alive pool
            # would open and close a TCP connection per request.
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )
        self._background: set[asyncio.Task[None]] = set()

    # ---- helpers -------------------------------------------------------------------------

    def _later(self, coroutine: Any) -> None:
        """Run cleanup that must not be cancelled with the request that needed it."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            try:
                await self.client.post("/abort_request", json={"rid": rid}, timeout=5.0)
            except httpx.HTTPError as exc:
                log.warning("could not abort %s at the engine: %s", rid, exc)

    def _unreachable(self, exc: Exception) -> Response:
        message = f"engine at {self.engine_url} did not answer: {type(exc).__name__}: {exc}"
        log.warning(message)
        if self.on_engine_error is not None:
            self.on_engine_error(message)
        detail = ErrorDetail(type="EngineUnavailable", message=message, retryable=True)
        return error_response(503, detail, RETRY_AFTER_S)

    def _not_ready(self, exc: VersionNotReady) -> Response:
        detail = WeightVersionNotReadyDetail(
            message=str(exc),
            requested={
                "min_version": exc.constraint.min_version,
                "exact_version": exc.constraint.exact_version,
            },
            latest_version=self.status.staging_target,
            fleet_versions={"self": exc.served},
            served_version=exc.served,
        )
        return error_response(409, detail, RETRY_AFTER_S)

    # ---- generate ------------------------------------------------------------------------

    async def generate(self, path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as exc:
            detail = ErrorDetail(type="InvalidRequest", message=f"body: not JSON ({exc})")
            return error_response(400, detail)
        if not isinstance(body, dict):
            detail = ErrorDetail(type="InvalidRequest", message="body: expected a JSON object")
            return error_response(400, detail)
        try:
            fields = RoutingFields.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in ("body", *first["loc"]))
            detail = ErrorDetail(type="InvalidRequest", message=f"{where}: {first['msg']}")
            return error_response(400, detail)
        wanted = fields.precisions()
        if wanted is not None and self.precision not in wanted:
            message = f"this engine serves {self.precision.value}, the request asks {wanted}"
            return error_response(409, ErrorDetail(type="PrecisionNotServed", message=message))
        if fields.run_id is not None and fields.run_id != self.run_id:
            message = f"this engine serves run {self.run_id!r}, the request asks {fields.run_id!r}"
            return error_response(409, ErrorDetail(type="RunNotServed", message=message))
        if not self.status.engine_reachable or self.status.terminal:
            detail = ErrorDetail(
                type="EngineUnavailable",
                message=f"engine at {self.engine_url} is out of service: {self.status.last_error}",
                retryable=True,
            )
            return error_response(503, detail, RETRY_AFTER_S)
        constraint = (
            fields.weight_version.constraint() if fields.weight_version else VersionConstraint()
        )
        try:
            admission = await self.gate.admit(constraint)
        except VersionNotReady as exc:
            return self._not_ready(exc)
        rids = prepare_body(body, admission.version)
        if fields.stream:
            return await self._stream(path, body, admission, rids)
        try:
            return await self._once(path, body, admission, rids, request)
        finally:
            await self.gate.release(admission)

    async def _once(
        self,
        path: str,
        body: dict[str, Any],
        admission: Admission,
        rids: list[str],
        request: Request,
    ) -> Response:
        call = asyncio.create_task(self.client.post(path, json=body))
        gone = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not call.done():
            call.cancel()
            self._later(self._abort(rids))
            log.info("client left; aborted %s at the engine", rids)
            return Response(status_code=499)
        try:
            reply = call.result()
        except httpx.HTTPError as exc:
            return self._unreachable(exc)
        if reply.status_code != 200 or "json" not in reply.headers.get("content-type", ""):
            return Response(
                reply.content,
                status_code=reply.status_code,
                media_type=reply.headers.get("content-type"),
            )
        payload = reply.json()
        span = stamp(payload, admission.version)
        headers = {}
        if span is not None:
            headers = {VERSION_START_HEADER: str(span[0]), VERSION_END_HEADER: str(span[1])}
        return JSONResponse(payload, headers=headers)

    async def _stream(
        self, path: str, body: dict[str, Any], admission: Admission, rids: list[str]
    ) -> Response:
        try:
            reply = await self.client.send(
                self.client.build_request("POST", path, json=body), stream=True
            )
        except httpx.HTTPError as exc:
            await self.gate.release(admission)
            return self._unreachable(exc)
        if reply.status_code != 200:
            content = await reply.aread()
            await reply.aclose()
            await self.gate.release(admission)
            return Response(
                content,
                status_code=reply.status_code,
                media_type=reply.headers.get("content-type"),
            )

        async def chunks() -> AsyncIterator[bytes]:
            done = False
            try:
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        done = True
                        yield b"data: [DONE]\n\n"
                        continue
                    try:
                        payload = json.loads(data)
                    except ValueError:
                        yield f"data: {data}\n\n".encode()
                        continue
                    stamp(payload, admission.version)
                    yield b"data: " + json.dumps(payload).encode() + b"\n\n"
            except httpx.HTTPError as exc:
                message = f"engine stream broke: {type(exc).__name__}: {exc}"
                error = {"message": message, "type": "EngineUnavailable", "retryable": True}
                yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
            finally:
                if not done:
                    self._later(self._abort(rids))
                self._later(reply.aclose())
                self._later(self.gate.release(admission))

        headers = {VERSION_START_HEADER: str(admission.version)}
        return StreamingResponse(chunks(), media_type="text/event-stream", headers=headers)

    # ---- app -----------------------------------------------------------------------------

    async def pass_through(self, path: str) -> Response:
        try:
            reply = await self.client.get(path, timeout=10.0)
        except httpx.HTTPError as exc:
            return self._unreachable(exc)
        return Response(
            reply.content,
            status_code=reply.status_code,
            media_type=reply.headers.get("content-type"),
        )

    def app(self) -> FastAPI:
        app = FastAPI(title="Tether engine agent (versioned proxy)")

        for path in GENERATE_PATHS:

            async def generate(request: Request, _path: str = path) -> Response:
                return await self.generate(_path, request)

            app.add_api_route(path, generate, methods=["POST"], name=f"generate {path}")

        for path in READ_ONLY_PATHS:

            async def read_only(_path: str = path) -> Response:
                return await self.pass_through(_path)

            app.add_api_route(path, read_only, methods=["GET"], name=f"read {path}")

        @app.get("/health")
        @app.get("/ready")
        async def health() -> Response:
            return Response(status_code=200 if self.status.healthy else 503)

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return self.server_info()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def other(path: str) -> Response:
            route = "/" + path
            if route in CONTROL_PATHS:
                message = (
                    f"{route} is an engine control route; only the engine agent changes "
                    "weights and scheduling (publish a version instead)"
                )
                return error_response(
                    403, ErrorDetail(type="ControlRouteForbidden", message=message)
                )
            message = f"{route} is not served by the engine agent"
            return error_response(404, ErrorDetail(type="NotFound", message=message))

        return app

    async def close(self) -> None:
        await self.client.aclose()


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has gone away (the body has been read already)."""
    while not await request.is_disconnected():
        # is_disconnected() only peeks; a blocking receive() here would eat messages.
        await asyncio.sleep(0.25)
