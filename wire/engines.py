"""Engines on the wire: the precision an engine serves, its kind, its sync state, registration,
heartbeats, the target long-poll and the fleet listing.

Imports pydantic only; the lease and routing rules that read these bodies live in the
control plane.
"""

from __future__ import annotations

from enum import StrEnum
from urllib.parse import urlsplit

from pydantic import Field, StrictInt, field_validator

from wire.body import MAX_INT, TetherModel, Version


class Precision(StrEnum):
    """The weight format an engine serves."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


class EngineKind(StrEnum):
    """The inference engine behind an agent (its agent adapts every kind to one contract)."""

    SGLANG = "sglang"
    VLLM = "vllm"


class SyncState(StrEnum):
    """What an engine is doing. `syncing` means staging a new version while still serving
    `applied_version`; `ready` and `syncing` engines take traffic, the others do not."""

    BOOTING = "booting"
    SYNCING = "syncing"
    READY = "ready"
    ERROR = "error"
    DRAINING = "draining"


SERVING_STATES = frozenset({SyncState.READY, SyncState.SYNCING})


def check_engine_url(url: str) -> str:
    """An engine URL the router can forward to: http(s), a host, a numeric port in range,
    no credentials, query or fragment. Raises ValueError saying what to fix."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"scheme {parts.scheme!r} is not http or https; use http://host:port")
    if not parts.hostname:
        raise ValueError("no host; use http://host:port")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"port in {parts.netloc!r} is not a number from 1 to 65535; use http://host:port"
        ) from exc
    if port == 0:
        raise ValueError("port 0 cannot be connected to; use the port the engine listens on")
    if parts.username is not None or parts.password is not None:
        raise ValueError("credentials in the URL are not allowed; engines are called without")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError("a query or fragment is not allowed; give the engine's base URL")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise ValueError("whitespace or control characters are not allowed")
    return url


class EngineRegister(TetherModel):
    url: str = Field(min_length=1, max_length=2000, pattern=r"^https?://")
    run_id: str = Field(min_length=1, max_length=128)
    precision: Precision
    engine_kind: EngineKind = EngineKind.SGLANG
    accelerator: str = Field(default="cpu", max_length=100)
    capacity: StrictInt = Field(default=1, ge=1, le=1_000_000)
    labels: dict[str, str] = Field(default_factory=dict)
    applied_version: Version | None = Field(default=None, ge=0, le=MAX_INT)
    sync_state: SyncState = SyncState.BOOTING

    @field_validator("url")
    @classmethod
    def _routable(cls, url: str) -> str:
        return check_engine_url(url)


class EngineRegistered(TetherModel):
    engine_id: str
    lease_seconds: float
    heartbeat_interval_s: float
    target_version: int | None


class FetchReport(TetherModel):
    """What the engine's last catch-up read to reach `version`, by source (bytes)."""

    version: Version = Field(ge=0, le=MAX_INT)
    store_bytes: StrictInt = Field(default=0, ge=0, le=MAX_INT)
    peer_bytes: StrictInt = Field(default=0, ge=0, le=MAX_INT)


class Heartbeat(TetherModel):
    applied_version: Version | None = Field(default=None, ge=0, le=MAX_INT)
    sync_state: SyncState
    staging_target: Version | None = Field(default=None, ge=0, le=MAX_INT)
    staging_progress: float = Field(default=0.0, ge=0.0, le=1.0)
    in_flight: StrictInt = Field(default=0, ge=0, le=MAX_INT)
    last_error: str | None = Field(default=None, max_length=4000)
    # The bytes of the last catch-up (the control plane sums them per version).
    fetched: FetchReport | None = None


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
    engine_kind: EngineKind
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
