"""What the trainer tells the control plane about its own view of the rollouts.

`GapReport` (`POST /v1/runs/{run_id}/gap`) carries one training step's sampler/trainer gap
per precision class and the staleness of the rollouts it learned from; the fleet overview
(`GET /v1/fleet/overview`, documented in docs/api.md) shows them. Names only, no logic.
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
