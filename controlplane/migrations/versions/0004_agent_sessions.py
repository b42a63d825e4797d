"""Multi-turn agent sessions and their turns' exact token ids.

`agent_sessions` holds one row per session (run, engine it is placed on, version policy,
expiry); `session_turns` one row per turn (the messages it added, the reply, the ids the
turn added to the prompt, the sampled ids and their logprobs, the weight version span).
Turns go with their session (ON DELETE CASCADE) when an expired session is swept.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agent_sessions",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("engine_id", sa.String(64), nullable=True),
        sa.Column("precision", sa.JSON(), nullable=True),
        sa.Column("version", sa.JSON(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False),
        sa.Column("ttl_s", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_agent_sessions_expires", "agent_sessions", ["expires_at"])
    op.create_index("ix_agent_sessions_run", "agent_sessions", ["run_id", "engine_id"])
    op.create_table(
        "session_turns",
        sa.Column(
            "session_id",
            sa.String(64),
            sa.ForeignKey("agent_sessions.session_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("turn", sa.Integer(), primary_key=True),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("reply", sa.JSON(), nullable=False),
        sa.Column("prompt_ids", sa.JSON(), nullable=False),
        sa.Column("completion_ids", sa.JSON(), nullable=False),
        sa.Column("logprobs", sa.JSON(), nullable=False),
        sa.Column("version_start", sa.Integer(), nullable=True),
        sa.Column("version_end", sa.Integer(), nullable=True),
        sa.Column("engine_id", sa.String(64), nullable=False),
        sa.Column("precision", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("session_turns")
    op.drop_index("ix_agent_sessions_run", "agent_sessions")
    op.drop_index("ix_agent_sessions_expires", "agent_sessions")
    op.drop_table("agent_sessions")
