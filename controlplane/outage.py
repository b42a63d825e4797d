"""What the control plane does while its database does not answer, and when it is back.

Owns recognising a database outage (a connection-level SQLAlchemy error, not a constraint
or a bug), answering it as a retryable 503 `DatabaseUnavailable` with Retry-After, logging
it as one warning line at most every few seconds (never a traceback per request), and the
two promises made to engines: the lease clock the router reads stops at the start of the
outage (for at most `stale_view_s`), and on recovery every lease that was alive when the
outage began is renewed for a full lease, so no engine drops out of the fleet because the
control plane itself could not write. Never routes and never serves HTTP itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from controlplane.errors import DatabaseUnavailable, InternalError, error_response

log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0


def is_database_down(exc: BaseException) -> bool:
    """Whether `exc` says the database is unreachable (as opposed to a bad statement)."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeout):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


DATABASE_ERRORS = (OperationalError, InterfaceError, PoolTimeout, DBAPIError)


class Outage:
    """The database outage state of one process (thread-safe)."""

    def __init__(self, registry: Any, retry_after_s: float, stale_view_s: float) -> None:
        self.registry = registry
        self.retry_after_s = retry_after_s
        self.stale_view_s = stale_view_s
        self.since: float | None = None
        self._lock = threading.Lock()
        self._logged_at = 0.0
        self._suppressed = 0
        # After a recovery: (the frozen clock, when the leases were renewed). The router's
        # snapshot still holds the leases read before the outage until a snapshot built
        # after the renewal is installed, so the clock stays frozen until then.
        self._thawing: tuple[float, float] | None = None

    def failed(self, exc: BaseException, during: str) -> DatabaseUnavailable:
        """Note a failed database call; the error to answer with."""
        now = time.time()
        with self._lock:
            if self.since is None:
                self.since = now
            if now - self._logged_at >= LOG_EVERY_S:
                detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
                log.warning(
                    "database unavailable for %.1fs (%s: %s)%s",
                    now - self.since,
                    during,
                    detail[0] if detail else type(exc).__name__,
                    f"; {self._suppressed} more failures since the last line"
                    if self._suppressed
                    else "",
                )
                self._logged_at, self._suppressed = now, 0
            else:
                self._suppressed += 1
        return DatabaseUnavailable(
            "the control plane's database is unavailable; retry after Retry-After",
            retry_after_s=self.retry_after_s,
        )

    def recover(self) -> None:
        """Call before a database write or read that follows a failure: renew the leases
        the outage would have let lapse. Raises (and stays in the outage) while the
        database is still away. Blocking: call it in a worker thread."""
        with self._lock:
            since = self.since
            if since is None:
                return
            renewed = self.registry.extend_leases(alive_at=since)
            self.since = None
            self._suppressed = 0
            self._thawing = (since, time.time())
        log.warning(
            "database answers again after %.1fs; renewed %d engine lease(s)",
            time.time() - since,
            renewed,
        )

    def view_refreshed(self, built_at: float) -> None:
        """A fleet snapshot read at `built_at` is now the router's: once one was read after
        the leases were renewed, the lease clock runs again."""
        with self._lock:
            if self._thawing is not None and built_at >= self._thawing[1]:
                self._thawing = None

    def settled(self) -> bool:
        """No outage, and no thaw waiting for a snapshot read after the lease renewal."""
        return self.since is None and self._thawing is None

    def lease_clock(self) -> float:
        """The time the router compares leases with: frozen at the start of an outage,
        for at most `stale_view_s`, so the last known fleet keeps serving; and after it,
        until a snapshot with the renewed leases is the router's (`view_refreshed`)."""
        now = time.time()
        since = self.since
        if since is None and self._thawing is not None:
            since = self._thawing[0]
        if since is not None and now - since < self.stale_view_s:
            return since
        return now


def install_outage_handlers(app: FastAPI, outage: Outage) -> None:
    """Answer database errors escaping a FastAPI route in the JSON error shape: 503 with
    Retry-After for an outage, 500 (with its traceback logged once) for anything else."""

    async def on_database_error(request: Request, exc: Exception) -> Response:
        if is_database_down(exc):
            return error_response(outage.failed(exc, request.url.path))
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(InternalError("internal error; see the server log"))

    for error in (DBAPIError, PoolTimeout):
        app.add_exception_handler(error, on_database_error)
