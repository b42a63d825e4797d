"""The router's lease clock around a database outage: frozen while the database is away,
and still frozen after it answers again until the router holds a fleet snapshot read after
the leases were renewed. Thawing it at the renewal itself would judge the snapshot read
before the outage (whose leases have lapsed by then) by the present time, and the only
engine of a run would be refused for one refresh interval after every outage."""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy.exc import OperationalError

from controlplane import db as dbmod
from controlplane.outage import Outage
from controlplane.registry import Registry


def outage_on_sqlite(tmp_path: Path) -> Outage:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    dbmod.migrate(url)
    sessions = dbmod.session_factory(dbmod.open_engine(url))
    return Outage(Registry(sessions, 10.0), retry_after_s=1.0, stale_view_s=60.0)


def connection_refused() -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))


def test_the_lease_clock_thaws_only_when_a_snapshot_read_after_the_renewal_is_installed(
    tmp_path: Path,
) -> None:
    outage = outage_on_sqlite(tmp_path)
    assert outage.lease_clock() >= time.time() - 1.0  # no outage: the clock is the time
    outage.failed(connection_refused(), "fleet refresh")
    since = outage.since
    assert since is not None
    assert outage.lease_clock() == since

    outage.recover()  # the database answers: leases renewed
    assert outage.since is None
    assert outage.lease_clock() == since  # the router still holds the pre-outage view

    outage.view_refreshed(built_at=since)  # a snapshot read before the renewal
    assert outage.lease_clock() == since

    outage.view_refreshed(built_at=time.time())  # read after the renewal
    assert outage.lease_clock() > since


def test_a_recovery_without_an_outage_leaves_the_clock_running(tmp_path: Path) -> None:
    outage = outage_on_sqlite(tmp_path)
    outage.recover()
    before = time.time()
    assert outage.lease_clock() >= before
