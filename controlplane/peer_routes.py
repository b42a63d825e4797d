"""The control plane's routes for peer-assisted fetch (docs/peers.md).

- `GET /v1/engines/{engine_id}/fetch-plan?version=V[&planning=true][&lanes=true][&since=S]
  [&version_lanes=true]` (engine role): the peers this engine should ask for the files of
  version V, nearest first; the store comes after them; with `planning`, V's claim and
  index when the plan names peers, and with `since` those of the versions between S and V
  too; with `lanes`, the peers of each of the trees V's files are dealt out to, and with
  `version_lanes` (and `since`) those of each version between, for that version's files.
- `POST /v1/engines/{engine_id}/peer-reports` (engine role): a peer served bad bytes,
  failed or stalled; it is left out of plans for `peer_suspect_s` and counted.
- `GET /v1/tokens/self` (any role): the caller's role, so an agent can check that a peer
  asking for files holds an engine token without a database of its own.

Plans are computed from the in-memory fleet snapshot (`controlplane/fetch_plan.py`), one
that lists the asking engine (a new one waits for the read its registration asked for); a
plan that names peers carries the version's claim and index, read from the store once per
version (`controlplane/planning_files.py`). These routes never log a token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Depends, FastAPI, Query
from fastapi.responses import Response

from controlplane.auth import ANY_ROLE, ENGINE
from controlplane.fetch_plan import plan_fetch
from controlplane.services import Services
from wire import MAX_INT, Role
from wire.peers import (
    EARLIER_PLANNING_MAX,
    EarlierPlanning,
    FetchPlan,
    PeerReport,
    PlanningFiles,
    TokenIdentity,
    VersionLanes,
)

# How long a plan request from an engine the fleet snapshot does not list yet (one that
# registered a moment ago) waits for a read that lists it (`Fleet.listing`); reads come
# within ~0.1 s of a registration.
PLAN_SNAPSHOT_WAIT_S = 2.0


def _earlier_versions(since: int, version: int) -> range:
    """The versions after `since` and before `version` a plan speaks of (the last
    `EARLIER_PLANNING_MAX`)."""
    return range(max(since + 1, version - EARLIER_PLANNING_MAX), version)


def _planning_bytes(files: PlanningFiles) -> int:
    """What a claim and index add to a plan (their JSON text, ASCII)."""
    return len(files.claim) + len(files.index)


async def _earlier(
    cp: Services, store_url: str, run_id: str, since: int, version: int, budget: int
) -> list[EarlierPlanning] | None:
    """The claim and index of the versions after `since` and before `version` (the last
    `EARLIER_PLANNING_MAX` of them) that can be read, oldest first while they fit in
    `budget` bytes; None when there are none. The engine reads the others from the store.

    Without them every engine of a fleet several versions behind read each earlier
    version's index from the store: in a 1,000-engine cold start on slow links, v1's index
    1,539 times (2.5 kB each, ~520 s of the store's egress), queued ahead of the shards
    the roots of the fetch trees read there, so one lane never started."""
    wanted = _earlier_versions(since, version)
    read = await asyncio.gather(*(cp.planning_files.get(store_url, run_id, v) for v in wanted))
    found = []
    for v, files in zip(wanted, read, strict=True):
        if files is None:
            continue
        budget -= _planning_bytes(files)
        if budget < 0:
            break
        found.append(EarlierPlanning(version=v, claim=files.claim, index=files.index))
    return found or None


RoleDependency = Callable[[frozenset[Role]], Callable[..., Coroutine[Any, Any, Role]]]


def install(app: FastAPI, cp: Services, role: RoleDependency) -> None:
    """Add the peer-fetch routes to `app`."""
    settings = cp.settings

    @app.get(
        "/v1/engines/{engine_id}/fetch-plan",
        response_model=FetchPlan,
        # Fields an agent did not ask for are left out, not sent as null: an older agent
        # refuses a plan with a field it does not know.
        response_model_exclude_none=True,
        tags=["engines"],
    )
    async def fetch_plan(
        engine_id: str,
        version: int = Query(ge=0, le=MAX_INT, description="the version being fetched"),
        planning: bool = Query(
            False,
            description="include the version's claim and index (`planning`) when the plan "
            "names peers; agents that check them ask, older agents (whose plan has no such "
            "field) do not",
        ),
        lanes: bool = Query(
            False,
            description="include `lanes` (one list of peers per tree; a version's files are "
            "dealt out to them); older agents, which follow `peers` for every file, do not ask",
        ),
        since: int | None = Query(
            None,
            ge=0,
            le=MAX_INT,
            description="the version the engine holds: with `planning`, also include the "
            "claim and index of the versions after it and before `version` (`earlier`)",
        ),
        version_lanes: bool = Query(
            False,
            description="with `since` and `lanes`, also include the lanes of each version "
            "after `since` and before `version` (`version_lanes`), for that version's files",
        ),
        _: Role = Depends(role(ENGINE)),
    ) -> FetchPlan:
        """Peers to fetch `version`'s files from, nearest first; then the store."""
        run_id = await cp.fleet.engine_run(engine_id)
        snapshot = await cp.fleet.listing(engine_id, PLAN_SNAPSHOT_WAIT_S)
        suspects = cp.suspects.current()

        def plan_of(v: int) -> FetchPlan:
            return plan_fetch(
                snapshot,
                engine_id,
                run_id,
                v,
                fanout=settings.peer_fanout,
                plan_size=settings.peer_plan_size,
                suspects=suspects,
            )

        plan = plan_of(version)
        if not lanes:
            plan.lanes = None
        elif version_lanes and since is not None and since + 1 < version:
            plan.version_lanes = [
                VersionLanes(version=v, lanes=plan_of(v).lanes or [])
                for v in _earlier_versions(since, version)
            ]
        cp.metrics.fetch_plans.labels("yes" if plan.peers else "no").inc()
        run = snapshot.runs.get(run_id)
        # Only with peers: an engine told to read the store (the tree's root, a lone
        # engine, peer fetch off) reads the claim and index there as it always did.
        if (
            planning
            and any(plan.lanes or [plan.peers])
            and run is not None
            and run.latest_version is not None
            and version <= run.latest_version
        ):
            plan.planning = await cp.planning_files.get(run.store_url, run_id, version)
            if plan.planning is not None and since is not None:
                budget = settings.planning_relay_max_bytes - _planning_bytes(plan.planning)
                plan.earlier = await _earlier(cp, run.store_url, run_id, since, version, budget)
        return plan

    @app.post("/v1/engines/{engine_id}/peer-reports", status_code=204, tags=["engines"])
    async def report_peer(
        engine_id: str, body: PeerReport, _: Role = Depends(role(ENGINE))
    ) -> Response:
        """A peer misbehaved while this engine fetched from it: leave it out for a while."""
        await cp.fleet.engine_run(engine_id)
        cp.suspects.report(engine_id, body)
        cp.metrics.peer_reports.labels(body.reason).inc()
        return Response(status_code=204)

    @app.get("/v1/tokens/self", response_model=TokenIdentity, tags=["auth"])
    async def token_self(found: Role = Depends(role(ANY_ROLE))) -> TokenIdentity:
        """The role of the calling token (401 for an unknown one)."""
        return TokenIdentity(role=found)
