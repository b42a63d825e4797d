"""Engines remember the credential that registered them.

`owner` is the sha256 of the registering bearer token (the tokens table stores the same
hash), so only that token (or an admin) may heartbeat as, change or deregister the engine.
Engines registered before this revision have no owner and stay manageable by any engine
token until they register again.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("owner", sa.String(64), nullable=True))
        batch.create_index("ix_engines_url", ["url"])


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.drop_index("ix_engines_url")
        batch.drop_column("owner")
