"""Agent sessions' records: the database rows and a bounded in-memory copy of recent ones.

Owns `Session`/`Turn` (what a session holds: its placement, version policy, expiry, and per
turn the messages it added, the reply, the ids it added to the prompt, the sampled ids and
their logprobs, the version span, engine and precision), and `SessionRecords`: create,
read (the database is the truth; memory keeps at most `capacity` sessions, least recently
used dropped first, and a copy is re-read when another replica added turns), append a
turn (only if nobody else appended that turn first), end, count live sessions per
engine, and sweep expired sessions. Blocking calls: the service runs them in threads.
Never decides placement and never talks to an engine.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as DbSession
from sqlalchemy.orm import sessionmaker

from controlplane.db import rows_affected
from controlplane.errors import SessionBusy
from controlplane.models import SessionRow, SessionTurnRow
from wire import Precision, SessionInfo, SessionState, SessionVersion, TurnRecord


@dataclass
class Turn:
    turn: int
    messages: list[dict[str, Any]]  # canonical, the ones this turn added
    reply: dict[str, Any]  # canonical
    prompt_ids: list[int]  # the ids this turn added to the prompt
    completion_ids: list[int]
    logprobs: list[float]
    version_start: int | None
    version_end: int | None
    engine_id: str
    precision: str
    finish_reason: str | None
    created_at: float


@dataclass
class Session:
    session_id: str
    run_id: str
    owner: str | None
    engine_id: str | None
    precision: list[str] | None
    version: dict[str, Any]
    labels: dict[str, str]
    ttl_s: float
    created_at: float
    expires_at: float
    ended_at: float | None = None
    turns: list[Turn] = field(default_factory=list)

    def history(self) -> list[dict[str, Any]]:
        """Every recorded message: each turn's new messages, then its reply."""
        out: list[dict[str, Any]] = []
        for turn in self.turns:
            out += turn.messages
            out.append(turn.reply)
        return out

    def token_ids(self) -> list[int]:
        """The last prompt plus its completion: what the next turn's prompt starts with."""
        out: list[int] = []
        for turn in self.turns:
            out += turn.prompt_ids
            out += turn.completion_ids
        return out

    def precisions(self) -> frozenset[Precision] | None:
        return None if self.precision is None else frozenset(Precision(p) for p in self.precision)

    def info(self) -> SessionInfo:
        return SessionInfo(
            session_id=self.session_id,
            run_id=self.run_id,
            state=SessionState.ACTIVE if self.ended_at is None else SessionState.ENDED,
            engine_id=self.engine_id,
            precision=None if self.precision is None else [Precision(p) for p in self.precision],
            version=SessionVersion.model_validate(self.version),
            labels=self.labels,
            turns=len(self.turns),
            created_at=self.created_at,
            expires_at=self.expires_at,
            ended_at=self.ended_at,
        )

    def records(self) -> list[TurnRecord]:
        out = []
        prompt: list[int] = []
        for turn in self.turns:
            prompt = prompt + turn.prompt_ids
            out.append(
                TurnRecord(
                    turn=turn.turn,
                    prompt_ids=prompt,
                    completion_ids=turn.completion_ids,
                    logprobs=turn.logprobs,
                    weight_version_start=turn.version_start,
                    weight_version_end=turn.version_end,
                    engine_id=turn.engine_id,
                    precision=Precision(turn.precision),
                    finish_reason=turn.finish_reason,
                    created_at=turn.created_at,
                )
            )
            prompt = prompt + turn.completion_ids
        return out


def _turn(row: SessionTurnRow) -> Turn:
    return Turn(
        turn=row.turn,
        messages=row.messages,
        reply=row.reply,
        prompt_ids=row.prompt_ids,
        completion_ids=row.completion_ids,
        logprobs=row.logprobs,
        version_start=row.version_start,
        version_end=row.version_end,
        engine_id=row.engine_id,
        precision=row.precision,
        finish_reason=row.finish_reason,
        created_at=row.created_at,
    )


class SessionRecords:
    def __init__(self, db: sessionmaker[DbSession], capacity: int) -> None:
        self._db = db
        self._capacity = capacity
        self._cache: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def _remember(self, session: Session) -> None:
        with self._lock:
            self._cache[session.session_id] = session
            self._cache.move_to_end(session.session_id)
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)

    def cached(self) -> int:
        return len(self._cache)

    def create(self, session: Session) -> None:
        with self._db.begin() as db:
            db.add(
                SessionRow(
                    session_id=session.session_id,
                    run_id=session.run_id,
                    owner=session.owner,
                    engine_id=session.engine_id,
                    precision=session.precision,
                    version=session.version,
                    labels=session.labels,
                    turns=0,
                    ttl_s=session.ttl_s,
                    created_at=session.created_at,
                    expires_at=session.expires_at,
                    ended_at=None,
                )
            )
        self._remember(session)

    def get(self, session_id: str) -> Session | None:
        """The session as the database has it now (turns re-read only if they changed)."""
        with self._db() as db:
            row = db.get(SessionRow, session_id)
            if row is None:
                with self._lock:
                    self._cache.pop(session_id, None)
                return None
            with self._lock:
                known = self._cache.get(session_id)
            if known is None or len(known.turns) != row.turns:
                rows = db.scalars(
                    select(SessionTurnRow)
                    .where(SessionTurnRow.session_id == session_id)
                    .order_by(SessionTurnRow.turn)
                ).all()
                turns = [_turn(r) for r in rows]
            else:
                turns = list(known.turns)
        session = Session(
            session_id=row.session_id,
            run_id=row.run_id,
            owner=row.owner,
            engine_id=row.engine_id,
            precision=row.precision,
            version=row.version,
            labels=row.labels,
            ttl_s=row.ttl_s,
            created_at=row.created_at,
            expires_at=row.expires_at,
            ended_at=row.ended_at,
            turns=turns,
        )
        self._remember(session)
        return session

    def append(self, session: Session, turn: Turn) -> None:
        """Record `turn` (the session's next) and the session's engine and expiry; refused
        (`SessionBusy`) when another request recorded that turn first."""
        expires = turn.created_at + session.ttl_s
        try:
            with self._db.begin() as db:
                moved = db.execute(
                    update(SessionRow)
                    .where(SessionRow.session_id == session.session_id)
                    .where(SessionRow.turns == turn.turn)
                    .where(SessionRow.ended_at.is_(None))
                    .values(turns=turn.turn + 1, engine_id=turn.engine_id, expires_at=expires)
                )
                if rows_affected(moved) != 1:
                    raise SessionBusy(
                        f"session {session.session_id!r}: turn {turn.turn} was recorded by "
                        "another request (or the session ended) meanwhile; send a session's "
                        "turns one at a time"
                    )
                db.add(
                    SessionTurnRow(
                        session_id=session.session_id,
                        turn=turn.turn,
                        messages=turn.messages,
                        reply=turn.reply,
                        prompt_ids=turn.prompt_ids,
                        completion_ids=turn.completion_ids,
                        logprobs=turn.logprobs,
                        version_start=turn.version_start,
                        version_end=turn.version_end,
                        engine_id=turn.engine_id,
                        precision=turn.precision,
                        finish_reason=turn.finish_reason,
                        created_at=turn.created_at,
                    )
                )
        except IntegrityError as exc:
            raise SessionBusy(
                f"session {session.session_id!r}: turn {turn.turn} is already recorded"
            ) from exc
        session.turns.append(turn)
        session.engine_id = turn.engine_id
        session.expires_at = expires
        self._remember(session)

    def place(self, session: Session, engine_id: str) -> None:
        """Record the engine a session (without a turn yet) was placed on."""
        with self._db.begin() as db:
            db.execute(
                update(SessionRow)
                .where(SessionRow.session_id == session.session_id)
                .values(engine_id=engine_id)
            )
        session.engine_id = engine_id

    def end(self, session: Session, now: float) -> None:
        with self._db.begin() as db:
            db.execute(
                update(SessionRow)
                .where(SessionRow.session_id == session.session_id)
                .where(SessionRow.ended_at.is_(None))
                .values(ended_at=now)
            )
        session.ended_at = session.ended_at or now

    def placed(self, run_id: str, now: float) -> dict[str, int]:
        """Live sessions per engine of the run (ended and expired ones do not count)."""
        with self._db() as db:
            rows = db.execute(
                select(SessionRow.engine_id, func.count())
                .where(SessionRow.run_id == run_id)
                .where(SessionRow.ended_at.is_(None))
                .where(SessionRow.expires_at > now)
                .where(SessionRow.engine_id.is_not(None))
                .group_by(SessionRow.engine_id)
            ).all()
        return {engine_id: count for engine_id, count in rows if engine_id is not None}

    def sweep(self, now: float | None = None) -> int:
        """Delete expired sessions and their turns; how many went."""
        now = time.time() if now is None else now
        with self._db.begin() as db:
            gone = db.scalars(
                select(SessionRow.session_id).where(SessionRow.expires_at <= now)
            ).all()
            if gone:
                # Turns first: SQLite enforces the cascade only with foreign keys on.
                db.execute(delete(SessionTurnRow).where(SessionTurnRow.session_id.in_(gone)))
                db.execute(delete(SessionRow).where(SessionRow.session_id.in_(gone)))
        with self._lock:
            for session_id in gone:
                self._cache.pop(session_id, None)
        return len(gone)
