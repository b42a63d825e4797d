"""Bearer tokens on the wire: the roles a token can speak for, minting requests and answers.

Hashing and checking tokens belong to the control plane; this module only names them.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from wire.body import TetherModel


class Role(StrEnum):
    """Who a bearer token speaks for."""

    ADMIN = "admin"
    TRAINER = "trainer"
    ENGINE = "engine"
    CLIENT = "client"
    # Reads the fleet overview and the dashboard's data; calls nothing that changes state.
    VIEWER = "viewer"


class TokenCreate(TetherModel):
    role: Role
    name: str = Field(default="", max_length=200)


class TokenCreated(TetherModel):
    """The token itself appears only here, once; the control plane keeps its hash."""

    token_id: int
    token: str
    role: Role
    name: str
