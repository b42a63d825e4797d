"""The fleet registry: engines register, heartbeat, deregister and hold leases.

Owns the `engines` and `pins` rows. Each call is one short transaction, so a heartbeat
costs one UPDATE. An engine belongs to the credential that registered it (`owner`, the
token's hash): only that token (or an admin, who passes no owner) may heartbeat as it or
deregister it, and registering the same URL again with the same token is the same engine.
A lapsed lease is as good as gone: heartbeats for it answer
`EngineUnknown` (the agent registers again) and snapshots leave it out. Never routes and
never decides targets (that is `router.py` and `policy.py`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import cast

from sqlalchemy import (
    Connection,
    Table,
    and_,
    bindparam,
    case,
    delete,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db import rows_affected
from controlplane.errors import EngineNotOwned, EngineUnknown, EngineUrlTaken, RunUnknown
from controlplane.models import EngineRow, PinRow, RunRow
from controlplane.replica_events import announce
from controlplane.snapshot import EngineView
from wire import EngineRegister, Heartbeat, Precision, SyncState

_ENGINES = cast(Table, EngineRow.__table__)
# A new staging target restarts the clock the Retry-After estimate is based on.
_HEARTBEAT = (
    update(_ENGINES)
    .where(
        _ENGINES.c.engine_id == bindparam("p_id"),
        _ENGINES.c.lease_expires_at > bindparam("p_now"),
        or_(
            bindparam("p_owner", type_=_ENGINES.c.owner.type).is_(None),
            _ENGINES.c.owner.is_(None),
            _ENGINES.c.owner == bindparam("p_owner"),
        ),
    )
    .values(
        applied_version=bindparam("p_applied"),
        sync_state=bindparam("p_state"),
        staging_target=bindparam("p_target"),
        staging_progress=bindparam("p_progress"),
        staging_started_at=case(
            (
                and_(
                    _ENGINES.c.staging_target == bindparam("p_target"),
                    _ENGINES.c.staging_started_at.is_not(None),
                ),
                _ENGINES.c.staging_started_at,
            ),
            else_=bindparam("p_started"),
        ),
        in_flight=bindparam("p_in_flight"),
        last_error=bindparam("p_error"),
        heartbeat_at=bindparam("p_now"),
        lease_expires_at=bindparam("p_expires"),
    )
)

# PostgreSQL: the whole batch is ONE statement in autocommit (atomic by itself), so one
# round trip per batch: the beats travel as arrays, RETURNING names the renewed rows.
_HEARTBEAT_PG = text(
    """
    UPDATE engines AS e SET
        applied_version = v.applied,
        sync_state = v.state,
        staging_target = v.target,
        staging_progress = v.progress,
        staging_started_at = CASE
            WHEN e.staging_target = v.target AND e.staging_started_at IS NOT NULL
            THEN e.staging_started_at ELSE v.started END,
        in_flight = v.in_flight,
        last_error = v.error,
        heartbeat_at = :now,
        lease_expires_at = :expires
    FROM unnest(
        CAST(:ids AS text[]), CAST(:applied AS integer[]), CAST(:states AS text[]),
        CAST(:targets AS integer[]), CAST(:progress AS float8[]), CAST(:started AS float8[]),
        CAST(:in_flight AS integer[]), CAST(:errors AS text[]), CAST(:owners AS text[])
    ) AS v(id, applied, state, target, progress, started, in_flight, error, owner)
    WHERE e.engine_id = v.id AND e.lease_expires_at > :now
        AND (v.owner IS NULL OR e.owner IS NULL OR e.owner = v.owner)
    RETURNING e.engine_id, v.owner
    """
)

_RENEWED = select(_ENGINES.c.engine_id, _ENGINES.c.owner).where(
    _ENGINES.c.engine_id.in_(bindparam("p_ids", expanding=True)),
    _ENGINES.c.lease_expires_at == bindparam("p_expires"),
)


class Registry:
    def __init__(self, sessions: sessionmaker[Session], lease_seconds: float) -> None:
        self._sessions = sessions
        self._db = sessions.kw["bind"]
        self.lease_seconds = lease_seconds
        self._postgres = self._db.dialect.name == "postgresql"
        # PostgreSQL heartbeats keep one autocommit connection: no pool checkout (and so no
        # pre-ping round trip) per batch. The lock keeps it to one batch at a time.
        self._beat_conn: Connection | None = None
        self._beat_lock = threading.Lock()

    def close(self) -> None:
        """Return the heartbeat connection to the pool (before the engine is disposed)."""
        with self._beat_lock:
            conn, self._beat_conn = self._beat_conn, None
            if conn is not None:
                conn.close()

    def register(self, body: EngineRegister, owner: str | None) -> tuple[str, float]:
        """Add an engine, or renew the registration `owner` already holds for this URL;
        return its id and lease expiry. `owner` None (an admin) may take over any URL."""
        now = time.time()
        url = body.url.rstrip("/")
        with self._sessions.begin() as db:
            if db.get(RunRow, body.run_id) is None:
                raise RunUnknown(
                    f"run {body.run_id!r} does not exist: create it first (POST /v1/runs)",
                    field="body.run_id",
                )
            kept: EngineRow | None = None
            for row in db.scalars(select(EngineRow).where(EngineRow.url == url)):
                live = row.lease_expires_at > now
                others = owner is not None and row.owner not in (None, owner)
                if live and others:
                    raise EngineUrlTaken(
                        f"engine URL {url!r} is registered by another credential: register "
                        "with that engine's token, or wait until its lease lapses",
                        field="body.url",
                    )
                if kept is None and not others:
                    kept = row
                else:
                    # One agent, one routing entry: older or lapsed duplicates go.
                    db.delete(row)
            engine = kept or EngineRow(engine_id=uuid.uuid4().hex, registered_at=now)
            engine.run_id = body.run_id
            engine.url = url
            engine.precision = body.precision.value
            engine.engine_kind = body.engine_kind.value
            engine.accelerator = body.accelerator
            engine.capacity = body.capacity
            engine.labels = dict(body.labels)
            engine.applied_version = body.applied_version
            engine.sync_state = body.sync_state.value
            engine.staging_target = None
            engine.staging_progress = 0.0
            engine.staging_started_at = None
            engine.in_flight = 0
            engine.last_error = None
            engine.heartbeat_at = now
            engine.lease_expires_at = now + self.lease_seconds
            engine.owner = owner if kept is None or owner is not None else kept.owner
            if kept is None:
                db.add(engine)
            announce(db, body.run_id)
            return engine.engine_id, now + self.lease_seconds

    def owned(self, engine_id: str, owner: str | None) -> None:
        """Raise `EngineUnknown` or `EngineNotOwned` unless `owner` may act as the engine."""
        with self._sessions() as db:
            row = db.get(EngineRow, engine_id)
            if row is None or row.lease_expires_at <= time.time():
                raise EngineUnknown(
                    f"engine {engine_id!r} is not registered or its lease lapsed: register again"
                )
            if owner is not None and row.owner not in (None, owner):
                raise EngineNotOwned(
                    f"engine {engine_id!r} was registered with another token; only that token "
                    "(or an admin token) may heartbeat as it, change it or deregister it"
                )

    def heartbeat(self, engine_id: str, beat: Heartbeat, owner: str | None = None) -> float:
        """Renew one lease and record the report; return the new lease expiry."""
        expires = self.heartbeat_many([(engine_id, beat)], [owner])[0]
        if expires is None:
            self.owned(engine_id, owner)
            raise EngineUnknown(f"engine {engine_id!r} is not registered: register again")
        return expires

    def heartbeat_many(
        self,
        beats: Sequence[tuple[str, Heartbeat]],
        owners: Sequence[str | None] | None = None,
    ) -> list[float | None]:
        """Apply many heartbeats in ONE transaction (group commit); per beat, the new lease
        expiry, or None where the engine is unknown, its lease already lapsed, or the
        beat's `owners` entry (the sender's token hash; None for an admin) does not own it.

        PostgreSQL: one UPDATE ... FROM unnest(...) RETURNING in autocommit, one round trip.
        SQLite (in process, no round trips): an executemany of the UPDATE, then a SELECT of
        the rows that now carry this batch's expiry, in one transaction.
        """
        now = time.time()
        expires = now + self.lease_seconds
        owners = list(owners) if owners is not None else [None] * len(beats)
        if self._postgres:
            renewed = self._renew_postgres(beats, owners, now, expires)
        else:
            renewed = self._renew_sqlite(beats, owners, now, expires)
        return [
            expires if (engine_id, owner) in renewed else None
            for (engine_id, _), owner in zip(beats, owners, strict=True)
        ]

    def _renew_postgres(
        self,
        beats: Sequence[tuple[str, Heartbeat]],
        owners: Sequence[str | None],
        now: float,
        expires: float,
    ) -> set[tuple[str, str | None]]:
        # One row per (engine, sender), its last beat in the batch. Only the rows whose
        # sender owns the engine pass the WHERE clause, so a stranger's beat in the same
        # batch never stands in for the owner's.
        latest = {(e, o): b for (e, b), o in zip(beats, owners, strict=True)}
        params = {
            "now": now,
            "expires": expires,
            "ids": [e for e, _ in latest],
            "applied": [b.applied_version for b in latest.values()],
            "states": [b.sync_state.value for b in latest.values()],
            "targets": [b.staging_target for b in latest.values()],
            "progress": [b.staging_progress for b in latest.values()],
            "started": [now if b.staging_target is not None else None for b in latest.values()],
            "in_flight": [b.in_flight for b in latest.values()],
            "errors": [b.last_error for b in latest.values()],
            "owners": [o for _, o in latest],
        }
        with self._beat_lock:
            for attempt in (1, 2):
                if self._beat_conn is None:
                    self._beat_conn = self._db.connect().execution_options(
                        isolation_level="AUTOCOMMIT"
                    )
                try:
                    rows = self._beat_conn.execute(_HEARTBEAT_PG, params).all()
                    return {(r[0], r[1]) for r in rows}
                except DBAPIError as exc:
                    conn, self._beat_conn = self._beat_conn, None
                    conn.close()
                    # A connection the server dropped is retried once on a fresh one.
                    if attempt == 2 or not exc.connection_invalidated:
                        raise
        raise AssertionError("unreachable: the loop returns or raises")

    def _renew_sqlite(
        self,
        beats: Sequence[tuple[str, Heartbeat]],
        owners: Sequence[str | None],
        now: float,
        expires: float,
    ) -> set[tuple[str, str | None]]:
        params = [
            {
                "p_id": engine_id,
                "p_owner": owner,
                "p_now": now,
                "p_applied": beat.applied_version,
                "p_state": beat.sync_state.value,
                "p_target": beat.staging_target,
                "p_progress": beat.staging_progress,
                "p_started": now if beat.staging_target is not None else None,
                "p_in_flight": beat.in_flight,
                "p_error": beat.last_error,
                "p_expires": expires,
            }
            for (engine_id, beat), owner in zip(beats, owners, strict=True)
        ]
        ids = list({engine_id for engine_id, _ in beats})
        with self._db.begin() as conn:
            conn.execute(_HEARTBEAT, params)
            renewed = conn.execute(_RENEWED, {"p_ids": ids, "p_expires": expires}).all()
        owner_of = {r[0]: r[1] for r in renewed}
        return {
            (engine_id, owner)
            for (engine_id, _), owner in zip(beats, owners, strict=True)
            if engine_id in owner_of and (owner is None or owner_of[engine_id] in (None, owner))
        }

    def extend_leases(self, alive_at: float) -> int:
        """Renew, for one lease from now, every lease that had not lapsed at `alive_at`
        (the start of a database outage); return how many."""
        now = time.time()
        with self._sessions.begin() as db:
            return rows_affected(
                db.execute(
                    update(EngineRow)
                    .where(
                        EngineRow.lease_expires_at > alive_at,
                        EngineRow.lease_expires_at < now + self.lease_seconds,
                    )
                    .values(lease_expires_at=now + self.lease_seconds)
                )
            )

    def deregister(self, engine_id: str, owner: str | None = None) -> None:
        """Remove the engine; `owner` (the caller's token hash, None for an admin) must
        own it."""
        with self._sessions.begin() as db:
            run_id = db.scalar(select(EngineRow.run_id).where(EngineRow.engine_id == engine_id))
            stmt = delete(EngineRow).where(EngineRow.engine_id == engine_id)
            if owner is not None:
                stmt = stmt.where(or_(EngineRow.owner.is_(None), EngineRow.owner == owner))
            if rows_affected(db.execute(stmt)) == 0:
                if db.get(EngineRow, engine_id) is not None:
                    raise EngineNotOwned(
                        f"engine {engine_id!r} was registered with another token; only that "
                        "token (or an admin token) may deregister it"
                    )
                raise EngineUnknown(f"engine {engine_id!r} is not registered")
            if run_id is not None:
                # The other replicas drop it now, not at their next periodic read.
                announce(db, run_id)

    def leased(self, now: float | None = None, since: float | None = None) -> list[EngineView]:
        """Every engine whose lease has not lapsed at `now`; with `since`, only those whose
        row was written (registered or heartbeat, `heartbeat_at`) at or after `since`."""
        now = time.time() if now is None else now
        written = EngineRow.heartbeat_at >= since if since is not None else true()
        with self._sessions() as db:
            rows = db.execute(
                select(
                    EngineRow.engine_id,
                    EngineRow.run_id,
                    EngineRow.url,
                    EngineRow.precision,
                    EngineRow.capacity,
                    EngineRow.applied_version,
                    EngineRow.sync_state,
                    EngineRow.in_flight,
                    EngineRow.staging_target,
                    EngineRow.staging_progress,
                    EngineRow.staging_started_at,
                    EngineRow.lease_expires_at,
                    EngineRow.accelerator,
                    EngineRow.labels,
                    EngineRow.last_error,
                    EngineRow.engine_kind,
                    EngineRow.registered_at,
                    EngineRow.owner,
                ).where(EngineRow.lease_expires_at > now, written)
            ).all()
        return [
            EngineView(
                engine_id=r[0],
                run_id=r[1],
                url=r[2],
                precision=Precision(r[3]),
                capacity=r[4],
                applied_version=r[5],
                sync_state=SyncState(r[6]),
                in_flight=r[7],
                staging_target=r[8],
                staging_progress=r[9],
                staging_started_at=r[10],
                lease_expires_at=r[11],
                accelerator=r[12],
                labels=r[13] or {},
                last_error=r[14],
                engine_kind=r[15],
                registered_at=r[16],
                owner=r[17],
            )
            for r in rows
        ]

    def rows(self, engine_id: str | None = None) -> list[EngineRow]:
        """Full rows of leased engines (for listings), optionally just one."""
        stmt = select(EngineRow).where(EngineRow.lease_expires_at > time.time())
        if engine_id is not None:
            stmt = stmt.where(EngineRow.engine_id == engine_id)
        with self._sessions() as db:
            return list(db.scalars(stmt.order_by(EngineRow.run_id, EngineRow.engine_id)))

    def reap(self, grace_s: float) -> int:
        """Delete engines whose lease lapsed more than `grace_s` ago."""
        with self._sessions.begin() as db:
            cut = time.time() - grace_s
            return rows_affected(
                db.execute(delete(EngineRow).where(EngineRow.lease_expires_at < cut))
            )

    def record_demand(self, demand: Mapping[tuple[str, int], float]) -> None:
        """Upsert the last time exact-version requests asked for each (run, version)."""
        if not demand:
            return
        with self._sessions.begin() as db:
            for (run_id, version), at in demand.items():
                pin = db.get(PinRow, (run_id, version))
                if pin is None:
                    db.add(PinRow(run_id=run_id, version=version, last_requested_at=at))
                elif pin.last_requested_at < at:
                    pin.last_requested_at = at

    def demand(self, since: float) -> dict[str, dict[int, float]]:
        with self._sessions() as db:
            rows = db.execute(select(PinRow).where(PinRow.last_requested_at >= since)).scalars()
            out: dict[str, dict[int, float]] = {}
            for pin in rows:
                out.setdefault(pin.run_id, {})[pin.version] = pin.last_requested_at
            return out
