"""The dashboard's HTTP surface: the overview route, the trainer's gap reports, the page.

Owns four things: `GET /v1/fleet/overview` (viewer, client or trainer tokens; the JSON the
page and `tether fleet` read), `GET /v1/runs/{run_id}/versions/{version}/convergence` (the
same readers; how one version spread, per precision), `POST /v1/runs/{run_id}/gap`
(trainer tokens; one step's sampler gap and rollout staleness), and the page itself
(`GET /dashboard` and its two assets, static files shipped in `controlplane/static/`, no
data and so no token: the page asks for one and sends it as a bearer header). Never
computes fleet data itself (`overview.py` does, once per snapshot) and never logs a token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response

from controlplane.auth import READERS, TRAINER
from controlplane.convergence import Spread
from controlplane.errors import NotFound
from controlplane.overview import Overview
from controlplane.services import Services
from wire import GapAccepted, GapReport, Role, SpreadFigures, VersionConvergence, VersionLagFigures

#: The page's files and their media types; nothing else is served from the folder.
ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# The page loads only its own files and talks only to this origin.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

RoleDependency = Callable[[frozenset[Role]], Callable[..., Coroutine[Any, Any, Role]]]


class VersionNotTracked(NotFound):
    """No convergence record of that version in this replica's memory."""


def asset(name: str) -> bytes:
    """One of the page's files, read from the installed package."""
    return resources.files("controlplane.static").joinpath(name).read_bytes()


def install(app: FastAPI, cp: Services, role: RoleDependency) -> Overview:
    """Add the dashboard's routes to `app`; the returned `Overview` observes `cp.fleet`."""
    overview = Overview(cp.metrics, cp.settings.lease_seconds)
    cp.fleet.observers.append(overview.observe)
    cp.heartbeats.fetch_observers.append(overview.convergence.note_fetch)
    pages = {name: asset(name) for name in ASSETS}

    @app.get(
        "/v1/fleet/overview",
        tags=["fleet"],
        response_class=Response,
        responses={200: {"content": {"application/json": {}}, "description": "the overview"}},
    )
    async def fleet_overview(_: Role = Depends(role(READERS))) -> Response:
        """Engines, per-precision summaries, each run's version timeline with convergence
        times, this replica's 409/retry rates and the trainer's gap reports (docs/api.md)."""
        return Response(overview.encoded(), media_type="application/json")

    @app.get(
        "/v1/runs/{run_id}/versions/{version}/convergence",
        response_model=VersionConvergence,
        tags=["versions"],
    )
    async def version_convergence(
        run_id: str, version: int, _: Role = Depends(role(READERS))
    ) -> VersionConvergence:
        """Seconds from publication until 50/90/99/100 % of the serving capacity served
        `version` (per precision and overall), the request version lag while it was the
        latest, and the bytes engines read for it from the store and from peers. Kept in
        memory by the replica that answers, for the run's last 32 versions."""
        if run_id not in cp.fleet.snapshot.runs:
            await asyncio.to_thread(cp.runs.get, run_id)  # RunUnknown (404) when absent
        spread = overview.convergence.spread(run_id, version)
        if spread is None:
            kept = [s["version"] for s in overview.convergence.timeline(run_id)]
            held = f"v{kept[0]} to v{kept[-1]}" if kept else "none yet"
            raise VersionNotTracked(
                f"this control plane keeps no convergence record of v{version} of run "
                f"{run_id!r} (it keeps {held}): ask for a version published since it "
                "started, at most 32 versions back"
            )
        lag = cp.metrics.version_lag

        def figures(precision: str, group: Spread) -> SpreadFigures:
            return SpreadFigures(
                precision=precision,
                capacity=group.capacity,
                serving_fraction=group.serving_fraction,
                **group.times(),
                request_lag=VersionLagFigures(
                    **lag.figures(run_id, version, None if precision == "all" else precision)
                ),
                store_bytes=group.store_bytes,
                peer_bytes=group.peer_bytes,
                engines_reported=len(group.fetched),
            )

        groups = sorted(spread.precisions.items())
        overall = Spread(
            reached=spread.reached,
            serving_fraction=spread.serving_fraction,
            capacity=sum(g.capacity for _, g in groups),
            fetched={f"{p}/{e}": b for p, g in groups for e, b in g.fetched.items()},
        )
        return VersionConvergence(
            run_id=run_id,
            version=version,
            published_at=spread.published_at,
            upper_bound=spread.upper_bound,
            run=figures("all", overall),
            precisions=[figures(p, g) for p, g in groups],
        )

    @app.post("/v1/runs/{run_id}/gap", response_model=GapAccepted, status_code=202, tags=["fleet"])
    async def report_gap(
        run_id: str, body: GapReport, _: Role = Depends(role(TRAINER))
    ) -> GapAccepted:
        """The trainer's sampler gap per precision and rollout staleness for one step."""
        if run_id not in cp.fleet.snapshot.runs:
            await asyncio.to_thread(cp.runs.get, run_id)  # RunUnknown (404) when absent
        kept = overview.report_gap(run_id, body)
        return GapAccepted(run_id=run_id, step=body.step, reports=kept)

    @app.get("/dashboard", tags=["fleet"], response_class=Response, include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(pages["dashboard.html"], media_type=ASSETS["dashboard.html"],
                        headers=PAGE_HEADERS)  # fmt: skip

    @app.get("/dashboard/{name}", response_class=Response, include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in pages or name == "dashboard.html":
            raise NotFound(f"no dashboard file {name!r}: open /dashboard")
        return Response(pages[name], media_type=ASSETS[name], headers=PAGE_HEADERS)

    return overview
