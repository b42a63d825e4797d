"""What the trainer tells the control plane about its own view of the rollouts.

`GapReport` (`POST /v1/runs/{run_id}/gap`) carries one training step's sampler/trainer gap
per precision class and the staleness of the rollouts it learned from; the fleet overview
(`GET /v1/fleet/overview`, documented in docs/api.md) shows them. `VersionConvergence`
(`GET /v1/runs/{run_id}/versions/{version}/convergence`) is how one version spread through
the fleet. Names only, no logic.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, StrictInt

from wire.body import MAX_INT, TetherModel, Version
from wire.engines import Precision


class PrecisionGap(TetherModel):
    """The sampler/trainer gap of one precision class in one training step
    (`trainer_client.gap_metrics.GapMetrics`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    k3_kl: float
    logprob_abs_diff: float | None = None
    masked_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    tokens: StrictInt = Field(default=0, ge=0, le=MAX_INT)


class GapReport(TetherModel):
    """One training step as the trainer saw it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    step: StrictInt = Field(ge=0, le=MAX_INT)
    trainer_version: Version | None = Field(default=None, ge=0, le=MAX_INT)
    precisions: dict[Precision, PrecisionGap] = Field(default_factory=dict, max_length=16)
    staleness_mean: float | None = Field(default=None, ge=0.0)
    staleness_max: StrictInt | None = Field(default=None, ge=0, le=MAX_INT)


class GapAccepted(TetherModel):
    run_id: str
    step: int
    reports: int


class VersionLagFigures(TetherModel):
    """Requests routed while the version was the run's latest: how many versions behind it
    the engine that served each one was."""

    requests: int
    p50: int | None
    p90: int | None
    p99: int | None
    max: int | None


class SpreadFigures(TetherModel):
    """How far one version got in one group of engines (a precision class, or all of them)."""

    precision: str
    capacity: int
    serving_fraction: float
    t50_s: float | None
    t90_s: float | None
    t99_s: float | None
    t100_s: float | None
    request_lag: VersionLagFigures
    store_bytes: int
    peer_bytes: int
    engines_reported: int


class VersionConvergence(TetherModel):
    """One version of one run: seconds from publication until 50/90/99/100 % of the serving
    capacity served it (or newer), per precision and for the whole run."""

    run_id: str
    version: int
    published_at: float
    upper_bound: bool
    run: SpreadFigures
    precisions: list[SpreadFigures]
