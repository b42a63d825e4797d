"""The Tether fields of a rollout request: the version it accepts, the precisions, the
session, and the direct-mode answers (`GET /v1/route`, `GET /v1/routes`).

Generate bodies belong to SGLang/OpenAI, so only their Tether fields are described here;
every other field passes through untouched. Imports pydantic and the store vocabulary.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from store.types import VersionConstraint
from wire.body import MAX_INT, TetherModel, Version
from wire.engines import Precision
from wire.headers import SESSION_ID_MAX, SESSION_ID_PATTERN


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
    # An empty list could never be served: it is refused, not retried.
    precision: Precision | list[Precision] | None = None
    # Forwarded to the engine as a header, so printable ASCII only.
    session_id: str | None = Field(
        default=None, max_length=SESSION_ID_MAX, pattern=SESSION_ID_PATTERN
    )
    run_id: str | None = Field(default=None, max_length=128)
    # Strict: "yes" or 1 is a mistake to name, not a truthy value to guess at.
    stream: StrictBool = False

    @field_validator("precision")
    @classmethod
    def _some_precision(
        cls, value: Precision | list[Precision] | None
    ) -> Precision | list[Precision] | None:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list matches no engine: name a precision or omit it")
        return value

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


class RouteCandidate(TetherModel):
    """One engine of a `GET /v1/routes` answer: where it is, what it serves, and its load
    as the router sees it (reported plus this control plane's own in-flight requests)."""

    engine_id: str
    url: str
    precision: Precision
    applied_version: int
    capacity: int
    in_flight: int


class RouteSet(TetherModel):
    """`GET /v1/routes`: every engine that may serve the constraint now, for clients that
    balance over engines themselves. Reuse it for `valid_for_s` seconds at most, then ask
    again; an engine that answers 409/503 or cannot be reached is dropped before then."""

    run_id: str
    engines: list[RouteCandidate]
    valid_for_s: float
