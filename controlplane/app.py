"""The control plane's FastAPI application: composition and routes.

Owns wiring (settings → database → registry, runs, fleet, proxy, metrics), the lifespan
(first admin token, snapshot refresher, the shared HTTP client) and the HTTP surface with
each route's roles. Business rules live in the modules it wires; this module only
translates HTTP to calls and back. Never imports torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from controlplane import dashboard, draining, peer_routes, session_routes
from controlplane import db as dbmod
from controlplane.auth import (
    ADMIN,
    ANY_ROLE,
    CALLERS,
    ENGINE,
    TRAINER,
    ensure_admin_token,
    mint_token,
)
from controlplane.errors import (
    ERROR_RESPONSES,
    ApiError,
    EngineUnknown,
    InvalidRequest,
    NoVersionYet,
    RunUnknown,
    install_handlers,
)
from controlplane.hotpath import ControlPlaneApp, HotLane, HotPath
from controlplane.long_poll import long_poll, wait_for_target
from controlplane.middleware import BodyLimit, RequestMetrics
from controlplane.outage import install_outage_handlers
from controlplane.pointer import confirm_published
from controlplane.proxy import (
    Proxy,
    check_run,
    no_engine,
    open_client,
    resolve_run,
    session_of,
    validation_error,
)
from controlplane.refusals import too_far_ahead
from controlplane.replica_events import ReplicaEvents, listens
from controlplane.router import eligible, pick
from controlplane.services import Services
from controlplane.settings import ControlPlaneSettings
from controlplane.snapshot import FleetSnapshot
from runtime import collector
from store.types import VersionConstraint
from wire import (
    MAX_INT,
    EngineInfo,
    EngineKind,
    EngineList,
    EngineRegister,
    EngineRegistered,
    Health,
    Heartbeat,
    HeartbeatReply,
    Precision,
    Role,
    RouteAnswer,
    RouteCandidate,
    RouteSet,
    RoutingFields,
    RunCreate,
    RunInfo,
    RunList,
    TargetPolicy,
    TargetReply,
    TokenCreate,
    TokenCreated,
    VersionInfo,
    VersionList,
    VersionNotify,
    WeightVersionSpec,
)

GENERATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": (
                        "An SGLang /generate or OpenAI body; the Tether fields below are "
                        "read, everything is forwarded unchanged."
                    ),
                    "properties": {
                        "weight_version": {"$ref": "#/components/schemas/WeightVersionSpec"},
                        "precision": {
                            "anyOf": [
                                {"type": "string", "enum": [p.value for p in Precision]},
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "string",
                                        "enum": [p.value for p in Precision],
                                    },
                                },
                            ]
                        },
                        "session_id": {"type": "string"},
                        "run_id": {"type": "string"},
                        "stream": {"type": "boolean"},
                    },
                    "additionalProperties": True,
                }
            }
        },
    }
}


def _engine_info(row: Any, target: int | None) -> EngineInfo:
    return EngineInfo(
        engine_id=row.engine_id,
        url=row.url,
        run_id=row.run_id,
        precision=Precision(row.precision),
        engine_kind=EngineKind(row.engine_kind),
        accelerator=row.accelerator,
        capacity=row.capacity,
        labels=row.labels,
        applied_version=row.applied_version,
        sync_state=row.sync_state,
        staging_target=row.staging_target,
        staging_progress=row.staging_progress,
        in_flight=row.in_flight,
        last_error=row.last_error,
        lease_expires_at=row.lease_expires_at,
        target_version=target,
    )


def create_app(settings: ControlPlaneSettings | None = None) -> FastAPI:
    """The ASGI application for one control-plane process (migrate the database first)."""
    settings = settings or ControlPlaneSettings()
    cp = Services.build(settings)
    bearer = HTTPBearer(auto_error=False, description="Tether token (tether token create)")

    def role(allowed: frozenset[Role]) -> Callable[..., Coroutine[Any, Any, Role]]:
        async def dependency(
            request: Request,
            _creds: HTTPAuthorizationCredentials | None = Depends(bearer),
        ) -> Role:
            found = await cp.tokens.role_of(request.headers.get("authorization"))
            return cp.tokens.check(found, allowed)

        return dependency

    async def engine_owner(request: Request, role: Role = Depends(role(ENGINE))) -> str | None:
        """The credential engines are bound to (None for an admin, who may act for any)."""
        return cp.tokens.owner_key(request.headers.get("authorization"), role)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        cp.first_admin_token = await asyncio.to_thread(
            ensure_admin_token, cp.sessions, settings.admin_token
        )
        client = open_client(settings.proxy_timeout_s)
        cp.proxy = Proxy(
            cp.fleet,
            cp.metrics,
            client,
            settings.route_attempts,
            settings.default_retry_after_s,
            settings.max_versions_ahead,
            settings.max_stream_bytes,
        )
        await cp.fleet.start()
        # The shutdown answers waiting long-polls at once (`controlplane.draining`).
        forget_drain = draining.on_begin(lambda: cp.fleet.call_soon(cp.wake_waiters))
        await cp.heartbeats.writer.start()
        await cp.store_sync.start()
        replicas = (
            ReplicaEvents(
                dbmod.normalise_url(settings.db_url), lambda: cp.versions_changed(whole=True)
            )
            if listens(dbmod.normalise_url(settings.db_url))
            else None
        )
        if replicas is not None:
            await replicas.start()
        # Serving from here on: what exists now is never garbage (`runtime.collector`).
        pauses = collector.PauseObserver(cp.metrics.gc_pause.observe)
        pauses.install()
        if settings.gc_settle:
            collector.settle()
        try:
            yield
        finally:
            if settings.gc_settle:
                collector.unsettle()
            pauses.remove()
            if replicas is not None:
                await replicas.stop()
            await cp.store_sync.stop()
            await cp.heartbeats.writer.stop()
            forget_drain()
            await cp.fleet.stop()
            await client.close()
            cp.registry.close()
            cp.engine.dispose()

    app = ControlPlaneApp(
        title="Tether control plane",
        version="0.1.0",
        description="Fleet registry, runs and versions, and the version-aware router. "
        'Every error is `{"error": {"type", "message", "retryable", ...}}`.',
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )
    app.state.cp = cp
    install_handlers(app)
    install_outage_handlers(app, cp.outage)
    # Both lanes pass the body limit and the request metrics; the hot lane skips the rest.
    limits = {"limit": settings.max_body_bytes, "header_limit": settings.max_header_bytes}
    app.add_middleware(BodyLimit, **limits)
    app.add_middleware(RequestMetrics, metrics=cp.metrics)
    hot_path = HotPath(cp)
    hot_limits = BodyLimit(hot_path, **limits)
    hot_metrics = RequestMetrics(hot_limits, cp.metrics)
    app.install_hot_lane(
        HotLane(hot_path, hot_metrics, hot_limits, hot_metrics, settings.hot_exchange)
    )

    dashboard.install(app, cp, role)
    app.state.chat_sessions = session_routes.install(app, cp, role)
    peer_routes.install(app, cp, role)

    # ------------------------------------------------------------------ ops

    @app.get("/healthz", response_model=Health, tags=["ops"])
    async def healthz() -> Health:
        return Health()

    @app.get("/readyz", response_model=Health, tags=["ops"])
    async def readyz() -> Health:
        await asyncio.to_thread(dbmod.ping, cp.engine)
        snap = cp.fleet.snapshot
        return Health(detail={"engines": len(snap.engines), "runs": len(snap.runs)})

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def metrics() -> Response:
        return Response(cp.metrics.render(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ tokens

    @app.post("/v1/tokens", response_model=TokenCreated, status_code=201, tags=["auth"])
    def create_token(body: TokenCreate, _: Role = Depends(role(ADMIN))) -> TokenCreated:
        token_id, text = mint_token(cp.sessions, body.role, body.name)
        return TokenCreated(token_id=token_id, token=text, role=body.role, name=body.name)

    # ------------------------------------------------------------------ runs

    @app.post("/v1/runs", response_model=RunInfo, status_code=201, tags=["runs"])
    def create_run(body: RunCreate, _: Role = Depends(role(TRAINER))) -> RunInfo:
        info = cp.runs.create(body)
        cp.fleet.poke()
        return info

    @app.get("/v1/runs", response_model=RunList, tags=["runs"])
    def list_runs(_: Role = Depends(role(ANY_ROLE))) -> RunList:
        return RunList(runs=cp.runs.all())

    @app.get("/v1/runs/{run_id}", response_model=RunInfo, tags=["runs"])
    def get_run(run_id: str, _: Role = Depends(role(ANY_ROLE))) -> RunInfo:
        return cp.runs.get(run_id)

    @app.put("/v1/runs/{run_id}/policy", response_model=RunInfo, tags=["runs"])
    def set_policy(run_id: str, body: TargetPolicy, _: Role = Depends(role(TRAINER))) -> RunInfo:
        info = cp.runs.set_policy(run_id, body)
        cp.fleet.poke()
        return info

    # ------------------------------------------------------------------ versions

    @app.post(
        "/v1/runs/{run_id}/versions", response_model=VersionInfo, status_code=201, tags=["versions"]
    )
    def notify_version(
        run_id: str, body: VersionNotify, _: Role = Depends(role(TRAINER))
    ) -> VersionInfo:
        run = cp.runs.get(run_id)
        pointer = confirm_published(run.store_url, run_id, body.version)
        info = cp.runs.record_version(run_id, body.version, body.kind, pointer)
        cp.fleet.poke()
        cp.fleet.call_soon(cp.wake_version_waiters)
        return info

    @app.get("/v1/runs/{run_id}/versions", response_model=VersionList, tags=["versions"])
    def list_versions(run_id: str, _: Role = Depends(role(ANY_ROLE))) -> VersionList:
        """The run's published versions the store still holds (`store gc` removes some)."""
        run = cp.runs.get(run_id)
        recorded = cp.runs.versions(run_id)
        held = cp.catalog.versions(run_id, run.store_url, [v.version for v in recorded])
        if held is None:  # the store cannot be listed right now: show what was published
            return VersionList(versions=recorded)
        return VersionList(versions=[v for v in recorded if v.version in held])

    @app.get("/v1/runs/{run_id}/versions/latest", response_model=VersionInfo, tags=["versions"])
    def latest_version(run_id: str, _: Role = Depends(role(ANY_ROLE))) -> VersionInfo:
        cp.runs.get(run_id)
        found = cp.runs.latest(run_id)
        if found is None:
            raise NoVersionYet(
                f"run {run_id!r} has no version yet: wait with GET /v1/runs/{run_id}/versions/wait"
            )
        return found

    @app.get("/v1/runs/{run_id}/versions/wait", response_model=VersionList, tags=["versions"])
    async def wait_version(
        run_id: str,
        after: int = Query(-1, ge=-1, le=MAX_INT, description="versions newer than this"),
        timeout: float = Query(30.0, ge=0, description="seconds to wait at most"),
        _: Role = Depends(role(ANY_ROLE)),
    ) -> VersionList:
        await asyncio.to_thread(cp.runs.get, run_id)

        async def check() -> list[VersionInfo] | None:
            found = await asyncio.to_thread(cp.runs.versions, run_id, after)
            return found or None

        async def wait(left: float) -> None:
            event = asyncio.Event()
            cp.version_events.append(event)
            try:
                await asyncio.wait_for(event.wait(), min(left, settings.poll_interval_s))
            except TimeoutError:
                return

        found = await long_poll(check, wait, min(timeout, settings.max_long_poll_s))
        return VersionList(versions=found or [])

    # ------------------------------------------------------------------ engines

    @app.post("/v1/engines", response_model=EngineRegistered, status_code=201, tags=["engines"])
    def register_engine(
        body: EngineRegister, owner: str | None = Depends(engine_owner)
    ) -> EngineRegistered:
        """Register an engine, bound to the calling token; the same URL registered again
        with the same token is the same engine (same id, one routing entry)."""
        try:
            run = cp.runs.get(body.run_id)
        except RunUnknown as exc:
            raise RunUnknown(
                f"run {body.run_id!r} does not exist: create it first (POST /v1/runs)",
                field="body.run_id",
            ) from exc
        applied = body.applied_version
        if applied is not None and not cp.runs.has_version(body.run_id, applied):
            held = cp.catalog.versions(body.run_id, run.store_url, [applied])
            if held is not None and applied not in held:
                raise InvalidRequest(
                    f"body.applied_version: run {body.run_id!r} has no version {applied} (its "
                    f"boot version is {run.boot_version}, latest {run.latest_version}): report "
                    "the version the engine really serves",
                    field="body.applied_version",
                )
        engine_id, _expires = cp.registry.register(body, owner)
        cp.fleet.poke()
        return EngineRegistered(
            engine_id=engine_id,
            lease_seconds=settings.lease_seconds,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            # A new engine follows the latest version until the policy has seen it.
            target_version=cp.runs.get(body.run_id).latest_version,
        )

    @app.post("/v1/engines/{engine_id}/heartbeat", response_model=HeartbeatReply, tags=["engines"])
    async def heartbeat(
        engine_id: str, body: Heartbeat, owner: str | None = Depends(engine_owner)
    ) -> Response:
        """Renew the lease, report the engine's state; answers the engine's target version.
        Only the token that registered the engine (or an admin) may (403 otherwise).

        Served by `controlplane/hotpath.py` (same roles and answers); declared here for
        the OpenAPI document."""
        reply = await cp.heartbeats.answer(engine_id, body, owner)
        return Response(reply, media_type="application/json")

    @app.get("/v1/engines/{engine_id}/target", response_model=TargetReply, tags=["engines"])
    async def engine_target(
        engine_id: str,
        after: int | None = Query(None, ge=0, le=MAX_INT, description="the known target"),
        timeout: float = Query(30.0, ge=0, description="seconds to wait at most"),
        _: Role = Depends(role(ENGINE)),
    ) -> TargetReply:
        """Wait (at most `timeout` s) for the engine's target to differ from `after`.

        Served by `controlplane/hotpath.py` (same roles and answers); declared here for
        the OpenAPI document."""
        return await wait_for_target(cp, engine_id, after, timeout)

    @app.delete("/v1/engines/{engine_id}", status_code=204, tags=["engines"])
    def deregister_engine(engine_id: str, owner: str | None = Depends(engine_owner)) -> Response:
        """Remove an engine; only the token that registered it (or an admin) may (403)."""
        cp.registry.deregister(engine_id, owner)
        cp.fleet.note_departed(engine_id)
        return Response(status_code=204)

    # Heartbeats may be answered before their commit: the listings wait for those commits,
    # so an engine (or its operator) reads its own beats back.
    @app.get("/v1/engines", response_model=EngineList, tags=["engines"])
    async def list_engines(
        run_id: str | None = None, _: Role = Depends(role(ANY_ROLE))
    ) -> EngineList:
        await cp.heartbeats.writer.flushed()
        rows = await asyncio.to_thread(cp.registry.rows)
        rows = [r for r in rows if run_id is None or r.run_id == run_id]
        snap = cp.fleet.snapshot
        return EngineList(
            engines=[_engine_info(r, snap.target_for(r.engine_id, r.run_id)) for r in rows]
        )

    @app.get("/v1/engines/{engine_id}", response_model=EngineInfo, tags=["engines"])
    async def get_engine(engine_id: str, _: Role = Depends(role(ANY_ROLE))) -> EngineInfo:
        await cp.heartbeats.writer.flushed()
        rows = await asyncio.to_thread(cp.registry.rows, engine_id)
        if not rows:
            raise EngineUnknown(f"engine {engine_id!r} is not registered or its lease lapsed")
        return _engine_info(rows[0], cp.fleet.snapshot.target_for(engine_id, rows[0].run_id))

    # ------------------------------------------------------------------ router

    async def forward(kind: str, request: Request) -> Response:
        assert cp.proxy is not None
        try:
            raw = await request.body()
        except ClientDisconnect:
            # Nobody is left to answer; the status is for the access log only.
            return Response(status_code=499)
        return await cp.proxy.handle(kind, raw, request.headers)

    @app.post("/v1/generate", tags=["router"], openapi_extra=GENERATE_BODY)
    async def generate(request: Request, _: Role = Depends(role(CALLERS))) -> Response:
        """SGLang's native /generate, routed to an engine that serves the version asked."""
        return await forward("generate", request)

    @app.post("/v1/completions", tags=["router"], openapi_extra=GENERATE_BODY)
    async def completions(request: Request, _: Role = Depends(role(CALLERS))) -> Response:
        return await forward("completions", request)

    @app.post("/v1/chat/completions", tags=["router"], openapi_extra=GENERATE_BODY)
    async def chat_completions(request: Request, _: Role = Depends(role(CALLERS))) -> Response:
        return await forward("chat", request)

    def route_query(
        request: Request,
        run_id: str | None,
        min_version: int | None,
        exact_version: int | None,
        session_id: str | None,
    ) -> tuple[FleetSnapshot, str, VersionConstraint, str | None]:
        """The checks `/v1/route` and `/v1/routes` share: the query's constraint and
        session, the run, and the refusals that do not depend on the engines."""
        try:
            spec = WeightVersionSpec(min_version=min_version, exact_version=exact_version)
        except ValidationError as exc:
            raise validation_error(exc, "query") from exc
        try:
            fields = RoutingFields(session_id=session_id)
        except ValidationError as exc:
            raise validation_error(exc, "query") from exc
        session = session_of(request.headers, fields)
        snap = cp.fleet.snapshot
        run = resolve_run(snap, run_id, "query.run_id")
        return snap, run, spec.constraint(), session

    async def admit_route(snap: FleetSnapshot, run: str, constraint: VersionConstraint) -> None:
        await check_run(cp.fleet, snap, run)
        ahead = too_far_ahead(snap, run, constraint, settings.max_versions_ahead, "query")
        if ahead is not None:
            raise ahead
        if constraint.exact_version is not None:
            cp.fleet.note_exact(run, constraint.exact_version)

    def none_eligible(
        snap: FleetSnapshot,
        run: str,
        constraint: VersionConstraint,
        precisions: frozenset[Precision] | None,
    ) -> ApiError:
        cp.metrics.not_ready.labels("none_eligible").inc()
        return no_engine(
            snap, run, constraint, precisions, settings.default_retry_after_s, "none_eligible"
        )

    @app.get("/v1/route", response_model=RouteAnswer, tags=["router"])
    async def route(
        request: Request,
        run_id: str | None = None,
        min_version: int | None = Query(None, ge=0, le=MAX_INT),
        exact_version: int | None = Query(None, ge=0, le=MAX_INT),
        precision: list[Precision] | None = Query(None),
        session_id: str | None = None,
        _: Role = Depends(role(CALLERS)),
    ) -> RouteAnswer:
        """Which engine to call, for clients that talk to engines directly."""
        snap, run, constraint, session = route_query(
            request, run_id, min_version, exact_version, session_id
        )
        await admit_route(snap, run, constraint)
        precisions = frozenset(precision) if precision else None
        engine = pick(
            snap,
            run,
            constraint,
            precisions=precisions,
            session_id=session,
            local_in_flight=cp.fleet.in_flight,
            now=cp.fleet.lease_clock(),
        )
        if engine is None:
            raise none_eligible(snap, run, constraint, precisions)
        cp.metrics.version_lag.note_pick(snap, run, engine)
        return RouteAnswer(
            engine_id=engine.engine_id,
            url=engine.url,
            precision=engine.precision,
            applied_version=engine.applied_version or 0,
            run_id=run,
        )

    @app.get("/v1/routes", response_model=RouteSet, tags=["router"])
    async def routes(
        request: Request,
        run_id: str | None = None,
        min_version: int | None = Query(None, ge=0, le=MAX_INT),
        exact_version: int | None = Query(None, ge=0, le=MAX_INT),
        precision: list[Precision] | None = Query(None),
        _: Role = Depends(role(CALLERS)),
    ) -> RouteSet:
        """Every engine that may serve the constraint now, for clients that balance over
        engines themselves and call them directly; reuse it for `valid_for_s` at most.
        Same checks and refusals as `/v1/route`."""
        snap, run, constraint, _session = route_query(
            request, run_id, min_version, exact_version, None
        )
        await admit_route(snap, run, constraint)
        precisions = frozenset(precision) if precision else None
        engines = eligible(snap, run, constraint, precisions=precisions, now=cp.fleet.lease_clock())
        if not engines:
            raise none_eligible(snap, run, constraint, precisions)
        local = cp.fleet.in_flight
        return RouteSet(
            run_id=run,
            engines=[
                RouteCandidate(
                    engine_id=e.engine_id,
                    url=e.url,
                    precision=e.precision,
                    applied_version=e.applied_version or 0,
                    capacity=e.capacity,
                    in_flight=e.in_flight + local.get(e.engine_id, 0),
                )
                for e in engines
            ],
            valid_for_s=settings.route_set_valid_s,
        )

    return app
