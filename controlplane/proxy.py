"""Forwards a generate request to the chosen engine and tries the next one on a 409/503.

Owns the hot path from raw body to engine response: reading the Tether fields, choosing an
engine (`router.pick`), forwarding with one shared keep-alive HTTP client, stamping the
engine id and precision on the answer, passing server-sent events through, and the 409
`WeightVersionNotReady` when no engine fits. Never touches the database; the only shared
state it changes is the in-process in-flight count and the exact-version demand buffer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from controlplane.errors import InvalidRequest, NoEngineAvailable, WeightVersionNotReady, field_path
from controlplane.fleet import Fleet
from controlplane.metrics import Metrics
from controlplane.router import pick, retry_after_s
from controlplane.schema import (
    ENGINE_ID_HEADER,
    RUN_HEADER,
    SESSION_HEADER,
    VERSION_END_HEADER,
    VERSION_START_HEADER,
    RoutingFields,
)
from controlplane.snapshot import EngineView, FleetSnapshot
from store.types import VersionConstraint

log = logging.getLogger(__name__)

# The engine path each Tether route forwards to (the agent serves SGLang's paths).
ENGINE_PATHS = {
    "generate": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
RETRY_STATUSES = frozenset({409, 503})
_JSON = {"content-type": "application/json"}


def validation_error(exc: ValidationError, prefix: str) -> InvalidRequest:
    first = exc.errors()[0]
    field = field_path((prefix, *first["loc"]))
    return InvalidRequest(f"{field}: {first['msg']}", field=field)


def parse_routing(raw: bytes) -> tuple[dict[str, Any], RoutingFields]:
    try:
        body = json.loads(raw) if raw else None
    except ValueError as exc:
        raise InvalidRequest(f"body: not valid JSON ({exc})", field="body") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("body: expected a JSON object", field="body")
    try:
        return body, RoutingFields.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, "body") from exc


def resolve_run(snap: FleetSnapshot, run_id: str | None, field: str) -> str:
    if run_id:
        return run_id
    if len(snap.runs) == 1:
        return next(iter(snap.runs))
    raise InvalidRequest(
        f"{field}: name the run (body field 'run_id' or header {RUN_HEADER}); "
        f"this control plane knows {len(snap.runs)} runs",
        field=field,
    )


def not_ready(
    snap: FleetSnapshot,
    run_id: str,
    constraint: VersionConstraint,
    default_retry_s: float,
    reason: str,
) -> WeightVersionNotReady:
    run = snap.runs.get(run_id)
    fleet_versions = {e.engine_id: e.applied_version for e in snap.run_engines(run_id)}
    return WeightVersionNotReady(
        f"no engine of run {run_id!r} serves {constraint.describe()} right now ({reason}); "
        "retry after Retry-After seconds",
        retry_after_s(snap, run_id, constraint, time.time(), default_retry_s),
        requested={
            "min_version": constraint.min_version,
            "exact_version": constraint.exact_version,
        },
        latest_version=run.latest_version if run else None,
        fleet_versions=fleet_versions,
    )


class Proxy:
    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        client: httpx.AsyncClient,
        attempts: int,
        default_retry_s: float,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.client = client
        self.attempts = attempts
        self.default_retry_s = default_retry_s

    def choose(
        self,
        run_id: str,
        fields: RoutingFields,
        session_id: str | None,
        exclude: set[str],
    ) -> EngineView | None:
        start = time.perf_counter()
        constraint = (
            fields.weight_version.constraint() if fields.weight_version else VersionConstraint()
        )
        engine = pick(
            self.fleet.snapshot,
            run_id,
            constraint,
            precisions=fields.precisions(),
            session_id=session_id,
            exclude=exclude,
            local_in_flight=self.fleet.in_flight,
            now=time.time(),
        )
        self.metrics.decision.observe(time.perf_counter() - start)
        return engine

    async def handle(self, kind: str, raw: bytes, headers: Mapping[str, str]) -> Response:
        _, fields = parse_routing(raw)
        snap = self.fleet.snapshot
        run_id = resolve_run(snap, fields.run_id or headers.get(RUN_HEADER), "body.run_id")
        session_id = headers.get(SESSION_HEADER) or fields.session_id
        constraint = (
            fields.weight_version.constraint() if fields.weight_version else VersionConstraint()
        )
        if constraint.exact_version is not None:
            self.fleet.note_exact(run_id, constraint.exact_version)
        forward_headers = dict(_JSON)
        if session_id:
            forward_headers[SESSION_HEADER] = session_id
        tried: set[str] = set()
        saw_not_ready = False
        for _ in range(self.attempts):
            engine = self.choose(run_id, fields, session_id, tried)
            if engine is None:
                break
            tried.add(engine.engine_id)
            url = engine.url + ENGINE_PATHS[kind]
            self.fleet.in_flight[engine.engine_id] += 1
            released = False

            def release(engine_id: str = engine.engine_id) -> None:
                self.fleet.in_flight[engine_id] -= 1

            try:
                if fields.stream:
                    request = self.client.build_request(
                        "POST", url, content=raw, headers=forward_headers
                    )
                    resp = await self.client.send(request, stream=True)
                    if resp.status_code in RETRY_STATUSES:
                        await resp.aclose()
                    else:
                        released = True
                        return self._stream(engine, resp, release)
                else:
                    resp = await self.client.post(url, content=raw, headers=forward_headers)
                    if resp.status_code not in RETRY_STATUSES:
                        return self._stamp(engine, resp)
            except httpx.TransportError as exc:
                log.warning("engine %s at %s failed: %s", engine.engine_id, engine.url, exc)
                self.metrics.engine_retries.labels("transport").inc()
                continue
            finally:
                if not released:
                    release()
            saw_not_ready = saw_not_ready or resp.status_code == 409
            self.metrics.engine_retries.labels(str(resp.status_code)).inc()
        if tried and not saw_not_ready:
            self.metrics.not_ready.labels("engines_unavailable").inc()
            raise NoEngineAvailable(
                f"{len(tried)} eligible engine(s) of run {run_id!r} failed to answer; retry",
                tried=sorted(tried),
            )
        reason = "engines_refused" if tried else "none_eligible"
        self.metrics.not_ready.labels(reason).inc()
        raise not_ready(self.fleet.snapshot, run_id, constraint, self.default_retry_s, reason)

    @staticmethod
    def _stamp(engine: EngineView, resp: httpx.Response) -> Response:
        headers = {ENGINE_ID_HEADER: engine.engine_id}
        content = resp.content
        media = resp.headers.get("content-type", "application/json")
        if resp.status_code == 200 and media.startswith("application/json"):
            try:
                body = json.loads(content)
            except ValueError:
                body = None
            if isinstance(body, dict):
                body["engine_id"] = engine.engine_id
                body["precision"] = engine.precision.value
                for key, header in (
                    ("weight_version_start", VERSION_START_HEADER),
                    ("weight_version_end", VERSION_END_HEADER),
                ):
                    if body.get(key) is not None:
                        headers[header] = str(body[key])
                content = json.dumps(body).encode()
        return Response(content, status_code=resp.status_code, headers=headers, media_type=media)

    @staticmethod
    def _stream(engine: EngineView, resp: httpx.Response, release: Any) -> Response:
        headers = {ENGINE_ID_HEADER: engine.engine_id}
        for header in (VERSION_START_HEADER, VERSION_END_HEADER):
            if header in resp.headers:
                headers[header] = resp.headers[header]

        async def body() -> AsyncIterator[bytes]:
            async for chunk in resp.aiter_raw():
                yield chunk

        async def close() -> None:
            release()
            await resp.aclose()

        return StreamingResponse(
            body(),
            status_code=resp.status_code,
            headers=headers,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            background=BackgroundTask(close),
        )
