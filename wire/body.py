"""What every Tether wire body shares: strict models and the integer range of a version.

Owns `TetherModel` (unknown fields are an error) and `Version`/`MAX_INT`. Imports pydantic
only; must never import FastAPI, SQLAlchemy or any Tether package.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictInt

Version = StrictInt
# Versions and counters live in 32-bit INTEGER columns on every database.
MAX_INT = 2**31 - 1


class TetherModel(BaseModel):
    """Tether's own bodies: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")
