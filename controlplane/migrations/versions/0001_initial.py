"""The first schema: runs, versions, engines, pins, tokens.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("store_url", sa.Text(), nullable=False),
        sa.Column("base_checkpoint", sa.Text(), nullable=True),
        sa.Column("canonical_dtype", sa.String(32), nullable=False),
        sa.Column("boot_version", sa.Integer(), nullable=False),
        sa.Column("latest_version", sa.Integer(), nullable=True),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "versions",
        sa.Column(
            "run_id",
            sa.String(128),
            sa.ForeignKey("runs.run_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=True),
        sa.Column("published_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "engines",
        sa.Column("engine_id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(128), nullable=False, index=True),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("precision", sa.String(16), nullable=False),
        sa.Column("accelerator", sa.String(100), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("applied_version", sa.Integer(), nullable=True),
        sa.Column("sync_state", sa.String(16), nullable=False),
        sa.Column("staging_target", sa.Integer(), nullable=True),
        sa.Column("staging_progress", sa.Float(), nullable=False),
        sa.Column("staging_started_at", sa.Float(), nullable=True),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("registered_at", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_engines_lease", "engines", ["lease_expires_at"])
    op.create_table(
        "pins",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("last_requested_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("token_id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    for table in ("tokens", "pins", "engines", "versions", "runs"):
        op.drop_table(table)
