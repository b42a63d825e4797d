"""Forwards a generate request to the chosen engine and tries the next one on a 409/503.

Owns the hot path from raw body to engine response: reading the Tether fields, choosing an
engine (`router.pick`), forwarding with one shared keep-alive HTTP client, stamping the
engine id and precision on the answer, passing server-sent events through (up to a byte
cap per stream), and the typed refusal (`refusals.py`) when no engine fits. Any failure to
forward to one engine (a bad URL, a refused connection, a broken answer) is that engine's
failure: the next eligible engine is tried, and the client never sees a 500 for it. Touches
the database only to tell an unknown run (404) from one the snapshot has not caught up
with; the only shared state it changes is the in-process in-flight count and the
exact-version demand buffer.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from controlplane.errors import ApiError, InvalidRequest, NoEngineAvailable, field_path
from controlplane.fleet import Fleet
from controlplane.metrics import Metrics
from controlplane.refusals import refusal, too_far_ahead
from controlplane.router import pick
from controlplane.snapshot import EngineView, FleetSnapshot
from http1.client import Answer, Upstream, UpstreamError
from store.types import VersionConstraint
from wire import (
    ENGINE_ID_HEADER,
    MAX_INT,
    RUN_HEADER,
    SESSION_HEADER,
    SESSION_ID_MAX,
    SESSION_ID_PATTERN,
    VERSION_END_HEADER,
    VERSION_START_HEADER,
    Precision,
    RoutingFields,
    WeightVersionSpec,
)

log = logging.getLogger(__name__)

# The engine path each Tether route forwards to (the agent serves SGLang's paths).
ENGINE_PATHS = {
    "generate": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
RETRY_STATUSES = frozenset({409, 503})
# Only these body fields are Tether's; the rest (prompts, sampling parameters, possibly
# megabytes of token ids) is the engine's and is forwarded as the bytes that arrived.
ROUTING_KEYS = tuple(RoutingFields.model_fields)
NO_ROUTING_FIELDS = RoutingFields()
ANY_VERSION = VersionConstraint()
VERSION_KEYS = frozenset(WeightVersionSpec.model_fields)
# Request headers are looked up by lower-case name (a plain dict on the hot lane).
RUN_KEY = RUN_HEADER.lower()
SESSION_KEY = SESSION_HEADER.lower()
# Header names as sent to the client (ASGI wants them lower-case bytes).
ENGINE_ID_RAW = ENGINE_ID_HEADER.lower().encode()
VERSION_START_RAW = VERSION_START_HEADER.lower().encode()
VERSION_END_RAW = VERSION_END_HEADER.lower().encode()
PASSED_THROUGH = tuple(h.lower() for h in (VERSION_START_HEADER, VERSION_END_HEADER))
SESSION_ID = re.compile(SESSION_ID_PATTERN)
SESSION_FIELD = f"header.{SESSION_HEADER}"


def open_client(timeout_s: float, connections: int = 2048) -> Upstream:
    """The keep-alive client a process forwards with (call inside the event loop).

    `timeout_s` is a read timeout: a long stream is fine as long as the engine keeps talking.
    """
    return Upstream(read_timeout_s=timeout_s, connect_timeout_s=5.0, max_connections=connections)


def validation_error(exc: ValidationError, prefix: str) -> InvalidRequest:
    first = exc.errors()[0]
    field = field_path((prefix, *first["loc"]))
    return InvalidRequest(f"{field}: {first['msg']}", field=field)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object (InvalidRequest naming `body` otherwise)."""
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"body: not valid JSON ({exc})", field="body") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("body: expected a JSON object", field="body")
    return body


def parse_routing(raw: bytes) -> tuple[RoutingFields, VersionConstraint]:
    """The Tether fields of a generate body; the rest is not looked at, let alone validated."""
    body = json_object(raw)
    ours = {key: body[key] for key in ROUTING_KEYS if key in body}
    if not ours:
        return NO_ROUTING_FIELDS, ANY_VERSION
    if len(ours) == 1 and "weight_version" in ours:
        plain = plain_constraint(ours["weight_version"])
        if plain is not None:
            return NO_ROUTING_FIELDS, plain
    try:
        fields = RoutingFields.model_validate(ours)
    except ValidationError as exc:
        raise validation_error(exc, "body") from exc
    return fields, fields.weight_version.constraint() if fields.weight_version else ANY_VERSION


def plain_constraint(spec: object) -> VersionConstraint | None:
    """The usual `weight_version` — an object of `min_version`/`exact_version`, each an int
    in range or null, that agree — read without pydantic. None for anything else, which
    then goes through `RoutingFields` so a mistake is named the same way as always."""
    if type(spec) is not dict or not spec.keys() <= VERSION_KEYS:
        return None
    low, exact = spec.get("min_version"), spec.get("exact_version")
    for value in (low, exact):
        if value is not None and (type(value) is not int or not 0 <= value <= MAX_INT):
            return None
    if low is not None and exact is not None and exact < low:
        return None
    return VersionConstraint(low, exact)


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


def session_of(headers: Mapping[str, str], fields: RoutingFields) -> str | None:
    """The request's session id: the `X-Session-ID` header, checked as the body's
    `session_id` is (it is forwarded to the engine as a header), else the body field."""
    header = headers.get(SESSION_KEY)
    if header is None:
        return fields.session_id
    if len(header) > SESSION_ID_MAX or SESSION_ID.match(header) is None:
        raise InvalidRequest(
            f"{SESSION_FIELD}: at most {SESSION_ID_MAX} printable ASCII characters "
            f"(got {len(header)} characters); shorten it or hash it",
            field=SESSION_FIELD,
        )
    return header or fields.session_id


async def check_run(fleet: Fleet, snap: FleetSnapshot, run_id: str) -> None:
    """`RunUnknown` (404) for a run that does not exist; a run created after the snapshot
    was built passes (its requests wait like any other)."""
    if run_id not in snap.runs:
        await asyncio.to_thread(fleet.runs.get, run_id)


def no_engine(
    snap: FleetSnapshot,
    run_id: str,
    constraint: VersionConstraint,
    precisions: frozenset[Precision] | None,
    default_retry_s: float,
    reason: str,
) -> ApiError:
    """The typed refusal for a request no engine took (see `refusals.py`)."""
    return refusal(snap, run_id, constraint, precisions, time.time(), default_retry_s, reason)


@dataclass(eq=False)
class Forward:
    """One generate request on its way to the engines: what it asks for, and the engines
    tried so far (the proxy's coroutine and the server's own exchange both drive it)."""

    path: str
    raw: bytes
    fields: RoutingFields
    constraint: VersionConstraint
    run_id: str
    session_id: str | None
    extra: tuple[tuple[str, str], ...]
    # False: the run is not in the snapshot yet; `check_run` tells unknown from new.
    known_run: bool
    attempts_left: int
    tried: set[str] = field(default_factory=set)
    saw_not_ready: bool = False


class Proxy:
    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        client: Upstream,
        attempts: int,
        default_retry_s: float,
        max_versions_ahead: int = 1000,
        max_stream_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.client = client
        self.attempts = attempts
        self.default_retry_s = default_retry_s
        self.max_versions_ahead = max_versions_ahead
        self.max_stream_bytes = max_stream_bytes

    def choose(
        self,
        run_id: str,
        constraint: VersionConstraint,
        fields: RoutingFields,
        session_id: str | None,
        exclude: set[str],
    ) -> EngineView | None:
        start = time.perf_counter()
        snap = self.fleet.snapshot
        engine = pick(
            snap,
            run_id,
            constraint,
            precisions=fields.precisions(),
            session_id=session_id,
            exclude=exclude,
            local_in_flight=self.fleet.in_flight,
            now=self.fleet.lease_clock(),
        )
        self.metrics.decision.observe(time.perf_counter() - start)
        if engine is not None:
            self.metrics.version_lag.note_pick(snap, run_id, engine)
        return engine

    def begin(self, kind: str, raw: bytes, headers: Mapping[str, str]) -> Forward:
        """Read and check what a generate request asks for, without touching the database
        or the fleet's counters; `admit` follows once its run is known to exist."""
        fields, constraint = parse_routing(raw)
        session_id = session_of(headers, fields)
        snap = self.fleet.snapshot
        run_id = resolve_run(snap, fields.run_id or headers.get(RUN_KEY), "body.run_id")
        extra = ((SESSION_HEADER, session_id),) if session_id else ()
        return Forward(
            ENGINE_PATHS[kind], raw, fields, constraint, run_id, session_id, extra,
            known_run=run_id in snap.runs, attempts_left=self.attempts,
        )  # fmt: skip

    def admit(self, forward: Forward) -> None:
        """Refuse a version too far ahead; note an exact-version demand. Past this the
        request counts as routed (metrics, demand)."""
        constraint = forward.constraint
        if not constraint.is_any:
            ahead = too_far_ahead(
                self.fleet.snapshot,
                forward.run_id,
                constraint,
                self.max_versions_ahead,
                "body.weight_version",
            )
            if ahead is not None:
                raise ahead
        if constraint.exact_version is not None:
            self.fleet.note_exact(forward.run_id, constraint.exact_version)

    async def handle(self, kind: str, raw: bytes, headers: Mapping[str, str]) -> Response:
        forward = self.begin(kind, raw, headers)
        if not forward.known_run:
            await check_run(self.fleet, self.fleet.snapshot, forward.run_id)
        self.admit(forward)
        return await self.forward(forward)

    async def forward(self, forward: Forward, engine: EngineView | None = None) -> Response:
        """Send an admitted request to engines until one answers (starting with `engine`,
        already taken by `next_engine`, if given); raises the refusal when none does."""
        while True:
            if engine is None:
                engine = self.next_engine(forward)
                if engine is None:
                    raise self.give_up(forward)
            try:
                answer = await self.client.post(
                    engine.url, forward.path, forward.raw, forward.extra, forward.fields.stream
                )
                response = self.settle(forward, engine, answer)
            except Exception as exc:
                self.failed(forward, engine, exc)
            except BaseException:
                _release(self.fleet.in_flight, engine.engine_id)
                raise
            else:
                if response is not None:
                    return response
            engine = None

    def next_engine(self, forward: Forward) -> EngineView | None:
        """The next engine to try (counted in flight until `settle` or `failed`), or None
        when the attempts are spent or no untried engine is eligible."""
        if forward.attempts_left <= 0:
            return None
        forward.attempts_left -= 1
        engine = self.choose(
            forward.run_id, forward.constraint, forward.fields, forward.session_id, forward.tried
        )
        if engine is not None:
            forward.tried.add(engine.engine_id)
            self.fleet.in_flight[engine.engine_id] += 1
        return engine

    def settle(self, forward: Forward, engine: EngineView, answer: Answer) -> Response | None:
        """The client's response from an engine's answer, or None to try the next engine
        (a 409 or 503). A streamed response holds the engine until the stream ends."""
        in_flight, engine_id = self.fleet.in_flight, engine.engine_id
        if answer.status not in RETRY_STATUSES:
            if forward.fields.stream:
                release = partial(_release, in_flight, engine_id)
                return EngineStream(engine, answer, release, self.max_stream_bytes)
            response = _stamp(engine, answer)
            _release(in_flight, engine_id)
            return response
        if forward.fields.stream:
            answer.close()
        _release(in_flight, engine_id)
        forward.saw_not_ready = forward.saw_not_ready or answer.status == 409
        self.metrics.engine_retries.labels(str(answer.status)).inc()
        return None

    def failed(self, forward: Forward, engine: EngineView, exc: Exception) -> None:
        """Forwarding to `engine` broke (a bad URL, a refused connection, a broken answer,
        a bug in reading it): that engine's failure, never the client's 500."""
        _release(self.fleet.in_flight, engine.engine_id)
        if isinstance(exc, UpstreamError):
            log.warning("engine %s at %s failed: %s", engine.engine_id, engine.url, exc)
        else:
            log.warning(
                "forwarding to engine %s at %s failed: %r", engine.engine_id, engine.url, exc
            )
        self.metrics.engine_retries.labels("transport").inc()

    def give_up(self, forward: Forward) -> ApiError:
        """The refusal once no engine answered: 503 if every tried engine failed to
        answer, else the typed 409 (`refusals.py`)."""
        tried, run_id = forward.tried, forward.run_id
        if tried and not forward.saw_not_ready:
            self.metrics.not_ready.labels("engines_unavailable").inc()
            return NoEngineAvailable(
                f"{len(tried)} eligible engine(s) of run {run_id!r} failed to answer; retry",
                tried=sorted(tried),
            )
        reason = "engines_refused" if tried else "none_eligible"
        self.metrics.not_ready.labels(reason).inc()
        return no_engine(
            self.fleet.snapshot,
            run_id,
            forward.constraint,
            forward.fields.precisions(),
            self.default_retry_s,
            reason,
        )


def _release(in_flight: dict[str, int], engine_id: str) -> None:
    in_flight[engine_id] -= 1


class Forwarded(Response):
    """A complete answer whose headers are already ASGI's lower-case byte pairs."""

    def __init__(self, status: int, body: bytes, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = raw_headers


def _stamp(engine: EngineView, answer: Answer) -> Response:
    """The engine's answer with the engine id and precision added (JSON) or as it came."""
    media = answer.headers.get("content-type", "application/json")
    content = answer.body
    raw = [(ENGINE_ID_RAW, engine.engine_id.encode())]
    if answer.status == 200 and media.startswith("application/json"):
        try:
            body = orjson.loads(content)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            body["engine_id"] = engine.engine_id
            body["precision"] = engine.precision  # a StrEnum: orjson writes its value
            start, end = body.get("weight_version_start"), body.get("weight_version_end")
            if start is not None:
                raw.append((VERSION_START_RAW, str(start).encode()))
            if end is not None:
                raw.append((VERSION_END_RAW, str(end).encode()))
            content = orjson.dumps(body)
    raw.append((b"content-type", media.encode("latin-1")))
    raw.append((b"content-length", str(len(content)).encode()))
    return Forwarded(answer.status, content, raw)


class EngineStream(Response):
    """Relays an engine's server-sent events and always lets go of the engine.

    Whatever ends the relay (the engine finishing, the client disconnecting, a cancelled
    task, the stream passing `max_bytes`) the engine's in-flight count is given back;
    unless the engine finished, its connection is closed, so the engine sees the client
    leave and stops generating. Past `max_bytes` the client gets one last event, an error
    in the shared shape (`StreamTooLarge`), instead of more output.
    """

    def __init__(
        self,
        engine: EngineView,
        answer: Answer,
        release: Callable[[], None],
        max_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        raw = [(ENGINE_ID_RAW, engine.engine_id.encode())]
        raw += [(h.encode(), answer.headers[h].encode("latin-1"))
                for h in PASSED_THROUGH if h in answer.headers]  # fmt: skip
        media = answer.headers.get("content-type", "text/event-stream")
        # The length is the engine's business: the body goes out chunked.
        raw.append((b"content-type", media.encode("latin-1")))
        self.status_code = answer.status
        self.background = None
        self.raw_headers = raw
        self.answer = answer
        self.release = release
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                finished = pump.result()
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            self.release()
            if finished:
                self.answer.release()
            else:
                self.answer.close()

    async def _pump(self, send: Send) -> bool:
        """Relay the stream; True if the engine finished it, False if it was cut off."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        sent = 0
        async for chunk in self.answer.chunks():
            sent += len(chunk)
            if sent > self.max_bytes:
                await send({"type": "http.response.body", "body": self._cut_off()})
                return False
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return True

    def _cut_off(self) -> bytes:
        error = {
            "error": {
                "type": "StreamTooLarge",
                "message": f"the stream passed the router's limit of {self.max_bytes} bytes and "
                "was stopped: ask for fewer tokens (max_new_tokens) or raise "
                "TETHER_MAX_STREAM_BYTES",
                "retryable": False,
                "limit": self.max_bytes,
            }
        }
        # The blank lines end any event the last chunk left open.
        return b"\n\ndata: " + orjson.dumps(error) + b"\n\n"


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
