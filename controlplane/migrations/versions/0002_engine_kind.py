"""Engines record their kind (`sglang`, `vllm`), reported at registration.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Engines registered before this revision were all SGLang-API engines.
    op.add_column(
        "engines",
        sa.Column("engine_kind", sa.String(16), nullable=False, server_default="sglang"),
    )


def downgrade() -> None:
    op.drop_column("engines", "engine_kind")
