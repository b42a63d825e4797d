"""Runs and their versions on the wire: creating a run, its target policy, listings, and
the trainer's "the pointer moved" notification.

The store stays the truth for versions; these bodies only mirror it. Imports pydantic and
the store vocabulary.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, StrictInt

from store.types import VersionKind
from wire.body import MAX_INT, TetherModel, Version


class PolicyKind(StrEnum):
    """How the control plane chooses each engine's target version."""

    FOLLOW_LATEST = "follow_latest"
    KEEP_PINNED = "keep_pinned"


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
