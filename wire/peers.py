"""Peer-assisted fetch on the wire: the fetch plan the control plane hands a catching-up
engine, the report of a peer that misbehaved, and who a token is (peers check callers).

Imports pydantic and the other wire modules only; how a plan is built belongs to the
control plane, how it is followed to the engine agent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from wire.body import MAX_INT, TetherModel, Version
from wire.tokens import Role

# Where an agent serves the version files it holds: GET {agent_url}{PEER_FILES_PATH}/{key},
# `key` as in the store ("<run>/updates/weight_v000007/<file>"); engine role required.
PEER_FILES_PATH = "/v1/peer/files"

FaultReason = Literal["digest", "size", "stall", "error", "unavailable"]


class PeerSource(TetherModel):
    """One peer to ask for files, with what the control plane last heard it holds."""

    engine_id: str
    url: str
    applied_version: int | None


class PlanningFiles(TetherModel):
    """A version's `.tether-claim` and index, exactly as the control plane read them from
    the store (UTF-8 text), so that an engine plans and verifies its catch-up without
    reading them itself. The engine checks them against each other (the claim records the
    index's size and digest) and the shards against the claim."""

    claim: str
    index: str


class EarlierPlanning(PlanningFiles):
    """The claim and index of a version of the chain before the plan's own."""

    version: int


class VersionLanes(TetherModel):
    """An engine's ancestors in each lane of the trees of one earlier version of its chain
    (`FetchPlan.version_lanes`)."""

    version: int
    lanes: list[list[PeerSource]]


class FetchPlan(TetherModel):
    """Where an engine catching up to `version` gets its files: `peers` in order, then the
    store (always last, always there). An empty list means: the store only. `planning`:
    the version's claim and index when the plan names peers and the control plane has
    them (absent: read them from the store). `earlier` (only for an agent that asks with
    `since=S`, alongside `planning`): the claim and index of the versions after S and
    before `version` that the control plane could read, at most `EARLIER_PLANNING_MAX` of
    them, so that an engine several versions behind plans its whole chain without reading
    a claim or index from the store.

    `lanes` (only for an agent that asks for them): the engine's ancestors in `len(lanes)`
    trees over the same engines, each nearest first. File *i* of a version (its place among
    the files the version's claim records, sorted by name) is asked of `lanes[i %
    len(lanes)]` only, then of the store, so every engine uploads about as much as it
    downloads and receives its files from several parents at once. `peers` is `lanes[0]`
    (what an agent that does not know lanes follows for every file).

    `version_lanes` (only for an agent that asks with `since=S` and `version_lanes`): the
    lanes of each version after S and before `version` (at most `EARLIER_PLANNING_MAX`), as
    its own plan would give them. A file of an earlier version is asked of that version's
    lanes: every engine fetching it, whatever version its pass heads for, then orders its
    peers by the same trees, so no two wait on each other for it (in the target's trees an
    engine registered between two publications can rank above one it ranks below in the
    earlier version's)."""

    version: int
    peers: list[PeerSource] = Field(default_factory=list)
    planning: PlanningFiles | None = None
    lanes: list[list[PeerSource]] | None = None
    earlier: list[EarlierPlanning] | None = None
    version_lanes: list[VersionLanes] | None = None


# The most earlier versions' claim and index one plan carries (`FetchPlan.earlier`): a
# chain longer than that reads the rest from the store.
EARLIER_PLANNING_MAX = 8


class PeerReport(TetherModel):
    """A peer that served bad bytes, failed or stalled while this engine fetched from it."""

    peer_url: str = Field(min_length=1, max_length=2000)
    reason: FaultReason
    key: str = Field(default="", max_length=1000)
    version: Version | None = Field(default=None, ge=0, le=MAX_INT)
    message: str = Field(default="", max_length=2000)


class TokenIdentity(TetherModel):
    """The role of the token that called (`GET /v1/tokens/self`)."""

    role: Role
