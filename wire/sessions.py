"""Multi-turn agent sessions on the wire: creating one, its status, its trajectory, and the
`tether` object each session turn's chat completion carries.

A session holds one conversation on one engine; the control plane keeps the exact token
ids the engine consumed and sampled, turn by turn ("token in, token out"). The chat
completion body itself is OpenAI's and is not modelled here. Imports pydantic and the
store vocabulary only.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from store.types import VersionConstraint
from wire.body import MAX_INT, TetherModel, Version
from wire.engines import Precision

#: How long a session lives after its last turn when the create body names no `ttl_s`.
DEFAULT_SESSION_TTL_S = 3600.0
MAX_SESSION_TTL_S = 7 * 86_400.0
MAX_LABELS = 32


class SessionVersion(TetherModel):
    """The weight versions a session accepts; exactly one field is set.

    `exact`: every turn on exactly that version (the episode stays on-policy for one
    version; the run's `keep_pinned` policy keeps engines on it). `min`: every turn on that
    version or newer. `max_lag`: each turn on a version at most that many behind the run's
    latest at the time of the turn.
    """

    exact: Version | None = Field(default=None, ge=0, le=MAX_INT)
    min: Version | None = Field(default=None, ge=0, le=MAX_INT)
    max_lag: StrictInt | None = Field(default=None, ge=0, le=MAX_INT)

    @model_serializer(mode="wrap")
    def _only_the_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, int]:
        # Written as it is given: {"exact": 3}, never {"exact": 3, "min": null, ...}.
        return {k: v for k, v in handler(self).items() if v is not None}

    @model_validator(mode="after")
    def _one_of(self) -> SessionVersion:
        given = [name for name in ("exact", "min", "max_lag") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of exact, min or max_lag, not {' and '.join(given)}")
        return self

    def constraint(self, latest: int | None) -> VersionConstraint:
        """The constraint one turn asks for, given the run's latest version now."""
        if self.exact is not None:
            return VersionConstraint(exact_version=self.exact)
        if self.min is not None:
            return VersionConstraint(min_version=self.min)
        if self.max_lag is not None and latest is not None:
            return VersionConstraint(min_version=max(0, latest - self.max_lag))
        return VersionConstraint()


class SessionCreate(TetherModel):
    """`POST /v1/sessions`. Without `version` the session takes the run's latest version
    at creation as its floor (`{"min": latest}`): it never goes back to older weights."""

    run_id: str = Field(min_length=1, max_length=128)
    version: SessionVersion | None = None
    precision: list[Precision] | None = Field(default=None, max_length=8)
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_s: float | None = Field(default=None, gt=0, le=MAX_SESSION_TTL_S)

    @field_validator("precision")
    @classmethod
    def _some_precision(cls, value: list[Precision] | None) -> list[Precision] | None:
        if value is not None and not value:
            raise ValueError("an empty list matches no engine: name a precision or omit it")
        return value

    @field_validator("labels")
    @classmethod
    def _small_labels(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_LABELS:
            raise ValueError(f"at most {MAX_LABELS} labels (got {len(value)})")
        for key, text in value.items():
            if not key or len(key) > 64 or len(text) > 256:
                raise ValueError("label keys are 1-64 characters, values at most 256")
        return value


class SessionState(StrEnum):
    ACTIVE = "active"
    ENDED = "ended"


class SessionInfo(TetherModel):
    """A session's status (`POST /v1/sessions` answers it with 201)."""

    session_id: str
    run_id: str
    state: SessionState
    engine_id: str | None  # None until an engine could take it
    precision: list[Precision] | None
    version: SessionVersion
    labels: dict[str, str]
    turns: int
    created_at: float
    expires_at: float
    ended_at: float | None = None


class TurnInfo(TetherModel):
    """The `tether` object of a session turn's chat completion."""

    session_id: str
    turn: int
    engine_id: str
    precision: Precision
    weight_version_start: int | None
    weight_version_end: int | None
    prompt_tokens: int
    new_prompt_tokens: int  # tokens of this turn's new messages (the rest is the record)
    completion_tokens: int
    # Prompt tokens the engine found in its prefix cache (None: the engine did not say).
    cached_tokens: int | None = None
    moved: bool  # this turn ran on another engine than the previous one


class TurnRecord(TetherModel):
    """One turn as the engine saw it: the whole prompt, the sampled ids, their logprobs."""

    turn: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampler logprob of each completion id
    weight_version_start: int | None
    weight_version_end: int | None
    engine_id: str
    precision: Precision
    finish_reason: str | None
    created_at: float


class Trajectory(TetherModel):
    """`GET /v1/sessions/{id}/trajectory`: per turn, and the whole episode as one token
    sequence. `token_ids` is the last turn's prompt plus its completion; `loss_mask` is 1
    exactly on model-sampled tokens; `logprobs[i]` is the sampler's logprob of
    `token_ids[i]` (0.0 where the mask is 0); `token_versions[i]` the weight version that
    sampled it (None where the mask is 0, or where the engine reported no version)."""

    session_id: str
    run_id: str
    state: SessionState
    turns: list[TurnRecord]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    token_versions: list[int | None]
    prompt_length: int  # tokens of the first turn's prompt
