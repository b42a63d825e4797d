"""`GET /healthz`: the one health body of the control plane."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from wire.body import TetherModel


class Health(TetherModel):
    status: Literal["ok"] = "ok"
    detail: dict[str, Any] = Field(default_factory=dict)
