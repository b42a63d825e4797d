"""The control plane's wire models: every request and response body, as pydantic models.

This module is the contract between the control plane, the engine agent and the trainer's
RolloutClient. It imports pydantic and the store vocabulary only, never FastAPI or
SQLAlchemy, so clients stay light. Tether's own bodies reject unknown fields; generate
bodies belong to SGLang/OpenAI, so only their Tether fields are described here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from store.types import VersionConstraint, VersionKind

Version = StrictInt
# Versions and counters live in 32-bit INTEGER columns on every database.
MAX_INT = 2**31 - 1

ENGINE_ID_HEADER = "X-Tether-Engine-Id"
VERSION_START_HEADER = "X-Tether-Weight-Version-Start"
VERSION_END_HEADER = "X-Tether-Weight-Version-End"
SESSION_HEADER = "X-Session-ID"
RUN_HEADER = "X-Tether-Run-Id"


class Role(StrEnum):
    """Who a bearer token speaks for."""

    ADMIN = "admin"
    TRAINER = "trainer"
    ENGINE = "engine"
    CLIENT = "client"


class Precision(StrEnum):
    """The weight format an engine serves."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


class SyncState(StrEnum):
    """What an engine is doing. `syncing` means staging a new version while still serving
    `applied_version`; `ready` and `syncing` engines take traffic, the others do not."""

    BOOTING = "booting"
    SYNCING = "syncing"
    READY = "ready"
    ERROR = "error"
    DRAINING = "draining"


SERVING_STATES = frozenset({SyncState.READY, SyncState.SYNCING})


class PolicyKind(StrEnum):
    """How the control plane chooses each engine's target version."""

    FOLLOW_LATEST = "follow_latest"
    KEEP_PINNED = "keep_pinned"


class TetherModel(BaseModel):
    """Tether's own bodies: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- errors


class ErrorDetail(BaseModel):
    """The one error shape. Extra keys carry the specifics (`field`, `requested`, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str
    message: str
    retryable: bool = False
    field: str | None = None


class ErrorBody(BaseModel):
    """Every non-2xx answer of the control plane: `{"error": {...}}`."""

    error: ErrorDetail


class WeightVersionNotReadyDetail(ErrorDetail):
    """409 from the router (or an engine agent): no engine serves an acceptable version."""

    type: Literal["WeightVersionNotReady"] = "WeightVersionNotReady"
    retryable: bool = True
    requested: dict[str, int | None]
    latest_version: int | None = None
    fleet_versions: dict[str, int | None] = Field(default_factory=dict)


# ---------------------------------------------------------------- routing fields


class WeightVersionSpec(TetherModel):
    """The version a rollout request accepts (Stitch's shape): at least `min_version`,
    exactly `exact_version`, or any version when both are null."""

    min_version: Version | None = Field(default=None, ge=0, le=MAX_INT)
    exact_version: Version | None = Field(default=None, ge=0, le=MAX_INT)

    @model_validator(mode="after")
    def _consistent(self) -> WeightVersionSpec:
        self.constraint()  # the store's rule; its InvalidVersion is a ValueError
        return self

    def constraint(self) -> VersionConstraint:
        return VersionConstraint(self.min_version, self.exact_version)


class RoutingFields(BaseModel):
    """The Tether fields of a generate body (`/v1/generate`, `/v1/completions`,
    `/v1/chat/completions`). Every other field is the engine's and passes through."""

    model_config = ConfigDict(extra="ignore")

    weight_version: WeightVersionSpec | None = None
    precision: Precision | list[Precision] | None = None
    # Forwarded to the engine as a header, so printable ASCII only.
    session_id: str | None = Field(default=None, max_length=512, pattern=r"^[ -~]*$")
    run_id: str | None = Field(default=None, max_length=128)
    stream: bool = False

    def precisions(self) -> frozenset[Precision] | None:
        if self.precision is None:
            return None
        if isinstance(self.precision, list):
            return frozenset(self.precision)
        return frozenset({self.precision})


class RouteAnswer(TetherModel):
    """`GET /v1/route`: which engine a direct client should call, and what it serves."""

    engine_id: str
    url: str
    precision: Precision
    applied_version: int
    run_id: str


# ---------------------------------------------------------------- tokens


class TokenCreate(TetherModel):
    role: Role
    name: str = Field(default="", max_length=200)


class TokenCreated(TetherModel):
    """The token itself appears only here, once; the control plane keeps its hash."""

    token_id: int
    token: str
    role: Role
    name: str


# ---------------------------------------------------------------- runs and versions


class RunCreate(TetherModel):
    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    store_url: str | None = Field(default=None, max_length=2000)
    base_checkpoint: str | None = Field(default=None, max_length=2000)
    canonical_dtype: str = Field(default="BF16", max_length=32)
    boot_version: Version = Field(default=0, ge=0, le=MAX_INT)


class TargetPolicy(TetherModel):
    """`follow_latest`: every engine converges to the pointer. `keep_pinned`: while
    exact-version requests for v arrived in the last `window_s` seconds, keep at least
    `engines` engines on v, as long as v is at most `max_lag` versions behind latest."""

    kind: PolicyKind = PolicyKind.FOLLOW_LATEST
    engines: StrictInt = Field(default=1, ge=1, le=10_000)
    window_s: float = Field(default=60.0, gt=0, le=86_400)
    max_lag: StrictInt = Field(default=16, ge=0, le=MAX_INT)


class RunInfo(TetherModel):
    run_id: str
    store_url: str
    base_checkpoint: str | None
    canonical_dtype: str
    boot_version: int
    latest_version: int | None
    policy: TargetPolicy
    created_at: float


class RunList(TetherModel):
    runs: list[RunInfo]


class VersionNotify(TetherModel):
    """The trainer says it moved the pointer to `version`; the store is checked."""

    version: Version = Field(ge=0, le=MAX_INT)
    kind: VersionKind | None = None


class VersionInfo(TetherModel):
    run_id: str
    version: int
    kind: VersionKind | None
    published_at: float


class VersionList(TetherModel):
    versions: list[VersionInfo]


# ---------------------------------------------------------------- engines


class EngineRegister(TetherModel):
    url: str = Field(min_length=1, max_length=2000, pattern=r"^https?://")
    run_id: str = Field(min_length=1, max_length=128)
    precision: Precision
    accelerator: str = Field(default="cpu", max_length=100)
    capacity: StrictInt = Field(default=1, ge=1, le=1_000_000)
    labels: dict[str, str] = Field(default_factory=dict)
    applied_version: Version | None = Field(default=None, ge=0, le=MAX_INT)
    sync_state: SyncState = SyncState.BOOTING


class EngineRegistered(TetherModel):
    engine_id: str
    lease_seconds: float
    heartbeat_interval_s: float
    target_version: int | None


class Heartbeat(TetherModel):
    applied_version: Version | None = Field(default=None, ge=0, le=MAX_INT)
    sync_state: SyncState
    staging_target: Version | None = Field(default=None, ge=0, le=MAX_INT)
    staging_progress: float = Field(default=0.0, ge=0.0, le=1.0)
    in_flight: StrictInt = Field(default=0, ge=0, le=MAX_INT)
    last_error: str | None = Field(default=None, max_length=4000)


class HeartbeatReply(TetherModel):
    target_version: int | None
    lease_expires_at: float


class TargetReply(TetherModel):
    """Answer of the engine's target long-poll; `changed` is false on timeout."""

    target_version: int | None
    changed: bool


class EngineInfo(TetherModel):
    engine_id: str
    url: str
    run_id: str
    precision: Precision
    accelerator: str
    capacity: int
    labels: dict[str, str]
    applied_version: int | None
    sync_state: SyncState
    staging_target: int | None
    staging_progress: float
    in_flight: int
    last_error: str | None
    lease_expires_at: float
    target_version: int | None


class EngineList(TetherModel):
    engines: list[EngineInfo]


# ---------------------------------------------------------------- ops


class Health(TetherModel):
    status: Literal["ok"] = "ok"
    detail: dict[str, Any] = Field(default_factory=dict)
