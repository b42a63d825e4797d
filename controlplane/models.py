"""The control plane's tables, as SQLAlchemy 2.0 typed models.

Owns the relational shape of runs, versions, engines, pins, tokens and agent sessions.
Times are float seconds since the epoch so SQLite and PostgreSQL compare them the same way.
Schema changes go through an Alembic migration in `controlplane/migrations/versions/`,
never `create_all`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class RunRow(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    store_url: Mapped[str] = mapped_column(Text)
    base_checkpoint: Mapped[str | None] = mapped_column(Text, nullable=True)
    canonical_dtype: Mapped[str] = mapped_column(String(32))
    boot_version: Mapped[int] = mapped_column(Integer)
    latest_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    policy: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)


class VersionRow(Base):
    __tablename__ = "versions"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str | None] = mapped_column(String(16), nullable=True)
    published_at: Mapped[float] = mapped_column(Float)


class EngineRow(Base):
    __tablename__ = "engines"
    __table_args__ = (
        Index("ix_engines_lease", "lease_expires_at"),
        Index("ix_engines_url", "url"),
    )

    engine_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128), index=True)
    url: Mapped[str] = mapped_column(Text)
    precision: Mapped[str] = mapped_column(String(16))
    engine_kind: Mapped[str] = mapped_column(String(16), server_default="sglang")
    accelerator: Mapped[str] = mapped_column(String(100))
    capacity: Mapped[int] = mapped_column(Integer)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    applied_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    sync_state: Mapped[str] = mapped_column(String(16))
    staging_target: Mapped[int | None] = mapped_column(Integer, nullable=True)
    staging_progress: Mapped[float] = mapped_column(Float, default=0.0)
    staging_started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    in_flight: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    registered_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    lease_expires_at: Mapped[float] = mapped_column(Float)
    # sha256 of the bearer token that registered the engine (see auth.hash_token).
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)


class PinRow(Base):
    """Exact-version demand: the last time a request asked for exactly `version`."""

    __tablename__ = "pins"

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_requested_at: Mapped[float] = mapped_column(Float)


class TokenRow(Base):
    __tablename__ = "tokens"

    token_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)


class SessionRow(Base):
    """One multi-turn agent session (`controlplane/chat_sessions.py`)."""

    __tablename__ = "agent_sessions"
    __table_args__ = (
        Index("ix_agent_sessions_expires", "expires_at"),
        Index("ix_agent_sessions_run", "run_id", "engine_id"),
    )

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128))
    # sha256 of the bearer token that created it (None: an admin's).
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    engine_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    precision: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    version: Mapped[dict[str, Any]] = mapped_column(JSON)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    turns: Mapped[int] = mapped_column(Integer, default=0)
    ttl_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class SessionTurnRow(Base):
    """One turn of a session: the messages it added, the reply, and the exact ids.

    `prompt_ids` holds only the ids this turn added after the previous turns' prompt and
    completion, so a long episode is stored once, not once per turn."""

    __tablename__ = "session_turns"

    session_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("agent_sessions.session_id", ondelete="CASCADE"), primary_key=True
    )
    turn: Mapped[int] = mapped_column(Integer, primary_key=True)
    messages: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    reply: Mapped[dict[str, Any]] = mapped_column(JSON)
    prompt_ids: Mapped[list[int]] = mapped_column(JSON)
    completion_ids: Mapped[list[int]] = mapped_column(JSON)
    logprobs: Mapped[list[float]] = mapped_column(JSON)
    version_start: Mapped[int | None] = mapped_column(Integer, nullable=True)
    version_end: Mapped[int | None] = mapped_column(Integer, nullable=True)
    engine_id: Mapped[str] = mapped_column(String(64))
    precision: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
