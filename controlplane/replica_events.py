"""Waking the other control-plane replicas when a run changes, over PostgreSQL.

Owns the `tether_fleet` channel: `announce` queues a NOTIFY in the writer's transaction
(PostgreSQL delivers it on commit, to every replica listening), and `ReplicaEvents` keeps
one LISTEN connection open per process, reconnecting with backoff, and calls back on every
notification (and after each reconnect, since notifications sent meanwhile are gone). The
periodic snapshot refresh stays the fallback; on SQLite both halves do nothing. Never reads
or writes tables.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from controlplane.background import BackgroundTask

log = logging.getLogger(__name__)

CHANNEL = "tether_fleet"
_NOTIFY = text("SELECT pg_notify(:channel, :payload)")


def announce(db: Session, payload: str) -> None:
    """Tell every replica, once `db`'s transaction commits, that `payload` (a run) changed."""
    if db.get_bind().dialect.name == "postgresql":
        db.execute(_NOTIFY, {"channel": CHANNEL, "payload": payload[:7000]})


def listens(db_url: str) -> bool:
    """Whether replicas on this database can wake each other (PostgreSQL only)."""
    return make_url(db_url).get_backend_name() == "postgresql"


class ReplicaEvents(BackgroundTask):
    """One LISTEN connection; `on_event` runs on the event loop for each notification."""

    def __init__(self, db_url: str, on_event: Callable[[], None]) -> None:
        super().__init__("replica-events", self._listen)
        url = make_url(db_url).set(drivername="postgresql")
        self._dsn = url.render_as_string(hide_password=False)
        self._where = url.render_as_string(hide_password=True)
        self.on_event = on_event

    async def _listen(self) -> None:
        import psycopg

        backoff = 0.5
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._dsn, autocommit=True, connect_timeout=5
                )
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    backoff = 0.5
                    self.on_event()
                    async for _notice in conn.notifies():
                        self.on_event()
            except (psycopg.Error, OSError) as exc:
                log.warning(
                    "listening for other replicas on %s failed (retry in %.1fs): %s",
                    self._where,
                    backoff,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc),
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
