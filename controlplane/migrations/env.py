"""Alembic environment: migrates the engine handed over in `config.attributes["engine"]`."""

from __future__ import annotations

from alembic import context

from controlplane.models import Base

engine = context.config.attributes["engine"]
with engine.begin() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata)
    with context.begin_transaction():
        context.run_migrations()
