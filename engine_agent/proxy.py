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
  `GET /metrics` (Prometheus: applied version, health, failed passes by error type),
  read-only `GET /model_info` and `GET /v1/models` passed through.

Must never change weights or decide versions; errors use the control plane's error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from engine_agent.engines.base import TETHER_FIELDS, Dialect, EngineRequest, UnsupportedRequest
from engine_agent.engines.sglang import SGLangDialect
from engine_agent.gate import Admission, AdmissionGate, VersionNotReady
from engine_agent.metrics import render as render_metrics
from engine_agent.status import AgentStatus
from store.sources.http import shared_tls
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

GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
READ_ONLY_PATHS = ("/model_info", "/get_model_info", "/v1/models")
# Every SGLang and vLLM route that mutates weights, the cache or scheduling (sglang-api §5,
# §9; docs/engines.md).
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
        # vLLM's (dev mode and scale-out): engines/vllm.py
        "/pause",
        "/resume",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/abort_requests",
        "/inference/v1/abort_requests",
        "/sleep",
        "/wake_up",
        "/weight_checker",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/scale_elastic_ep",
    }
)
RETRY_AFTER_S = 1


def error_response(status: int, detail: ErrorDetail, retry_after: int | None = None) -> Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = ErrorBody(error=detail).model_dump(mode="json", exclude_none=True)
    return JSONResponse(body, status_code=status, headers=headers)


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


def version_reported(payload: Any) -> bool:
    """Whether the engine labelled this answer with its own weight version."""
    for item in payload if isinstance(payload, list) else [payload]:
        if isinstance(item, dict):
            meta = item.get("meta_info") or item.get("metadata") or {}
            if meta.get("weight_versions") or meta.get("weight_version") is not None:
                return True
    return False


def _finished(payload: Any) -> bool:
    """Whether an SSE chunk is the last of its answer (it carries a finish reason)."""
    if not isinstance(payload, dict):
        return False
    meta = payload.get("meta_info") or {}
    if meta.get("finish_reason") is not None:
        return True
    return any(c.get("finish_reason") for c in payload.get("choices") or [] if isinstance(c, dict))


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
        dialect: Dialect | None = None,
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
        self.dialect = dialect or SGLangDialect()
        # More routes for the agent's app (e.g. the peer file route), added before the
        # catch-all that refuses control routes.
        self.extra_routes: list[Callable[[FastAPI], None]] = []
        self.client = httpx.AsyncClient(
            base_url=self.engine_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            verify=shared_tls(),  # a new TLS context per client costs 0.1 s of CPU
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
        await self.dialect.abort(self.client, rids)

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
        for name in TETHER_FIELDS:
            body.pop(name, None)
        try:
            call = await self.dialect.request(path, body, admission.version, self.client)
        except UnsupportedRequest as exc:
            await self.gate.release(admission)
            return error_response(400, ErrorDetail(type="InvalidRequest", message=str(exc)))
        except httpx.HTTPError as exc:
            await self.gate.release(admission)
            return self._unreachable(exc)
        if fields.stream:
            return await self._stream(call, admission)
        try:
            return await self._once(call, admission, request)
        finally:
            await self.gate.release(admission)

    def _span(self, payload: Any, admission: Admission) -> tuple[int, int] | None:
        """Stamp `payload`; an answer without the engine's own spans that ended after a
        commit ran on the new weights from then on (an `in_place` commit keeps it going)."""
        span = stamp(payload, admission.version)
        served = self.gate.served_version
        if span is None or served is None or served <= span[1] or version_reported(payload):
            return span
        for item in payload if isinstance(payload, list) else [payload]:
            if isinstance(item, dict) and "weight_version_end" in item:
                item["weight_version_end"] = served
        return span[0], served

    async def _once(
        self, engine_call: EngineRequest, admission: Admission, request: Request
    ) -> Response:
        rids = engine_call.rids
        call = asyncio.create_task(self.client.post(engine_call.path, json=engine_call.body))
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
        payload = self.dialect.reply(engine_call, reply.json())
        span = self._span(payload, admission)
        headers = {}
        if span is not None:
            headers = {VERSION_START_HEADER: str(span[0]), VERSION_END_HEADER: str(span[1])}
        return JSONResponse(payload, headers=headers)

    async def _stream(self, call: EngineRequest, admission: Admission) -> Response:
        rids = call.rids
        translate = self.dialect.stream(call)
        try:
            reply = await self.client.send(
                self.client.build_request("POST", call.path, json=call.body), stream=True
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
                        payload = translate(json.loads(data))
                    except ValueError:
                        yield f"data: {data}\n\n".encode()
                        continue
                    if payload is None:
                        continue
                    if _finished(payload):
                        self._span(payload, admission)
                    else:
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

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(render_metrics(self.status), media_type="text/plain; version=0.0.4")

        for install in self.extra_routes:
            install(app)

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
