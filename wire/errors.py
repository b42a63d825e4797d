"""The one error shape of every non-2xx answer, and the router's retryable 409 body.

Owns the JSON shape `{"error": {...}}`; raising and mapping exceptions to it belongs to each
service. Imports pydantic only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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


class WeightVersionUnavailableDetail(ErrorDetail):
    """409 that will not change by waiting: no engine serves the version, and none
    will (it is older than what engines keep, or the store deleted it). Not retryable;
    `nearest_servable_version` is the closest version a request could get instead."""

    type: Literal["WeightVersionUnavailable"] = "WeightVersionUnavailable"
    retryable: bool = False
    requested: dict[str, int | None]
    latest_version: int | None = None
    nearest_servable_version: int | None = None


class PrecisionNotServedDetail(ErrorDetail):
    """409: the run has engines, but none of the requested precision(s). Not retryable."""

    type: Literal["PrecisionNotServed"] = "PrecisionNotServed"
    retryable: bool = False
    requested_precisions: list[str]
    fleet_precisions: list[str]
