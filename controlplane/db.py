"""Database connections and migrations for the control plane.

Owns engine creation (SQLite in WAL mode with a busy timeout, PostgreSQL via psycopg) and
running Alembic to head. Never creates tables any other way than through migrations.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Result, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def normalise_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` and pick the psycopg 3 driver for them."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def open_engine(url: str) -> Engine:
    """An SQLAlchemy engine tuned for short transactions from many threads."""
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=8,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_size=16, max_overflow=16, pool_pre_ping=True)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def migrate(url: str) -> str:
    """Bring the database at `url` to the newest schema; return the head revision."""
    from alembic import command
    from alembic.config import Config

    url = normalise_url(url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = open_engine(url)
    try:
        command.upgrade(cfg, "head")
    finally:
        cfg.attributes["engine"].dispose()
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(cfg).get_current_head() or ""
    log.info("database %s migrated to %s", make_url(url).render_as_string(True), head)
    return head


def ping(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def rows_affected(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed (its result is always a cursor result)."""
    return cast(CursorResult[Any], result).rowcount
