"""Runs and their versions, mirrored from the store for fast listing.

Owns the `runs` and `versions` rows. A version is recorded only after the store's pointer
is confirmed to name it (or a newer one), and a run's latest version only moves forward.
Every change is announced to the other replicas (`controlplane.replica_events`). Never
writes to the store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db import rows_affected
from controlplane.errors import RunExists, RunUnknown, StoreUrlRefused
from controlplane.models import RunRow, VersionRow
from controlplane.replica_events import announce
from controlplane.snapshot import RunView
from store.types import VersionKind
from wire import RunCreate, RunInfo, TargetPolicy, VersionInfo


def run_info(run: RunRow) -> RunInfo:
    return RunInfo(
        run_id=run.run_id,
        store_url=run.store_url,
        base_checkpoint=run.base_checkpoint,
        canonical_dtype=run.canonical_dtype,
        boot_version=run.boot_version,
        latest_version=run.latest_version,
        policy=TargetPolicy.model_validate(run.policy),
        created_at=run.created_at,
    )


def version_info(row: VersionRow) -> VersionInfo:
    return VersionInfo(
        run_id=row.run_id,
        version=row.version,
        kind=VersionKind(row.kind) if row.kind else None,
        published_at=row.published_at,
    )


def _location(url: str) -> tuple[str, str]:
    """(scheme, where) of a store URL; folders and file:// URLs as resolved real paths, so
    `..` and symbolic links cannot step out of a root."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    if scheme == "file":
        return "file", os.path.realpath(rest)
    return scheme, rest.rstrip("/")


def store_allowed(url: str, roots: Sequence[str]) -> bool:
    """Whether `url` is one of `roots` or lies under one of them (same scheme)."""
    try:
        scheme, where = _location(url)
    except ValueError:  # e.g. a NUL byte, which no path may hold
        return False
    for root in roots:
        root_scheme, root_where = _location(root)
        if scheme == root_scheme and (
            where == root_where or where.startswith(root_where.rstrip("/") + "/")
        ):
            return True
    return False


class Runs:
    def __init__(
        self, sessions: sessionmaker[Session], default_store: str, roots: Sequence[str] = ()
    ) -> None:
        self._sessions = sessions
        self.default_store = default_store
        # The control plane reads runs' pointers and listings: only where it is allowed.
        self.roots = list(roots) or [default_store]

    def create(self, body: RunCreate) -> RunInfo:
        store_url = body.store_url or self.default_store
        if not store_allowed(store_url, self.roots):
            raise StoreUrlRefused(
                f"body.store_url: {store_url!r} is outside the store roots this control plane "
                f"may read ({', '.join(self.roots)}): use a store under one of them, or add "
                "its root to TETHER_STORE_ROOTS (comma-separated)",
                field="body.store_url",
            )
        run = RunRow(
            run_id=body.run_id,
            store_url=store_url,
            base_checkpoint=body.base_checkpoint,
            canonical_dtype=body.canonical_dtype,
            boot_version=body.boot_version,
            latest_version=None,
            policy=TargetPolicy().model_dump(mode="json"),
            created_at=time.time(),
        )
        try:
            with self._sessions.begin() as db:
                db.add(run)
                announce(db, body.run_id)
        except IntegrityError as exc:
            raise RunExists(
                f"run {body.run_id!r} already exists: pick another id or use the existing run",
                field="body.run_id",
            ) from exc
        return run_info(run)

    def get(self, run_id: str) -> RunInfo:
        with self._sessions() as db:
            run = db.get(RunRow, run_id)
            if run is None:
                raise RunUnknown(f"run {run_id!r} does not exist (list runs: GET /v1/runs)")
            return run_info(run)

    def all(self) -> list[RunInfo]:
        with self._sessions() as db:
            return [run_info(r) for r in db.scalars(select(RunRow).order_by(RunRow.created_at))]

    def views(self) -> list[RunView]:
        with self._sessions() as db:
            rows = db.execute(
                select(
                    RunRow.run_id,
                    RunRow.latest_version,
                    RunRow.policy,
                    VersionRow.published_at,
                    RunRow.store_url,
                    RunRow.boot_version,
                ).join(
                    VersionRow,
                    (VersionRow.run_id == RunRow.run_id)
                    & (VersionRow.version == RunRow.latest_version),
                    isouter=True,
                )
            ).all()
        return [
            RunView(
                run_id=r[0],
                latest_version=r[1],
                latest_published_at=r[3],
                policy=TargetPolicy.model_validate(r[2]),
                store_url=r[4],
                boot_version=r[5],
            )
            for r in rows
        ]

    def set_policy(self, run_id: str, policy: TargetPolicy) -> RunInfo:
        with self._sessions.begin() as db:
            stmt = (
                update(RunRow)
                .where(RunRow.run_id == run_id)
                .values(policy=policy.model_dump(mode="json"))
            )
            if rows_affected(db.execute(stmt)) == 0:
                raise RunUnknown(f"run {run_id!r} does not exist")
            announce(db, run_id)
        return self.get(run_id)

    def record_version(
        self, run_id: str, version: int, kind: VersionKind | None, pointer_version: int
    ) -> VersionInfo:
        """Record `version` (and the pointer's, if newer) and advance the run's latest.

        The trainer's notification and the store sync (or another replica) may record the
        same version at the same moment: the one whose insert loses the race finds the row
        on its second try, so both answer with it."""
        try:
            return self._record_version(run_id, version, kind, pointer_version)
        except IntegrityError:
            return self._record_version(run_id, version, kind, pointer_version)

    def _record_version(
        self, run_id: str, version: int, kind: VersionKind | None, pointer_version: int
    ) -> VersionInfo:
        now = time.time()
        with self._sessions.begin() as db:
            for v, k in {pointer_version: None, version: kind}.items():
                row = db.get(VersionRow, (run_id, v))
                if row is None:
                    db.add(
                        VersionRow(
                            run_id=run_id, version=v, kind=k.value if k else None, published_at=now
                        )
                    )
                elif k is not None and row.kind is None:
                    row.kind = k.value
            db.flush()
            db.execute(
                update(RunRow)
                .where(
                    RunRow.run_id == run_id,
                    or_(RunRow.latest_version.is_(None), RunRow.latest_version < pointer_version),
                )
                .values(latest_version=pointer_version)
            )
            announce(db, run_id)
            row = db.get(VersionRow, (run_id, version))
            assert row is not None
            return version_info(row)

    def versions(self, run_id: str, after: int | None = None) -> list[VersionInfo]:
        self.get(run_id)
        stmt = select(VersionRow).where(VersionRow.run_id == run_id)
        if after is not None:
            stmt = stmt.where(VersionRow.version > after)
        with self._sessions() as db:
            return [version_info(v) for v in db.scalars(stmt.order_by(VersionRow.version))]

    def has_version(self, run_id: str, version: int) -> bool:
        """Whether `version` is the run's boot version or one it recorded as published."""
        with self._sessions() as db:
            run = db.get(RunRow, run_id)
            if run is None:
                raise RunUnknown(f"run {run_id!r} does not exist (list runs: GET /v1/runs)")
            return version == run.boot_version or db.get(VersionRow, (run_id, version)) is not None

    def latest(self, run_id: str) -> VersionInfo | None:
        with self._sessions() as db:
            row = db.scalars(
                select(VersionRow)
                .where(VersionRow.run_id == run_id)
                .order_by(VersionRow.version.desc())
                .limit(1)
            ).first()
            return version_info(row) if row else None
