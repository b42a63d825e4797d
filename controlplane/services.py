"""The parts of one control-plane process, built from its settings and shared by both lanes
(FastAPI's routes in `app` and the hot lane in `hotpath`).

Owns construction only: which part gets which collaborator. It serves no request and must
never import `app` or `hotpath`, which both read it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from controlplane import db as dbmod
from controlplane.auth import TokenChecker
from controlplane.catalog import Catalog
from controlplane.fetch_plan import Suspects
from controlplane.fleet import Fleet
from controlplane.heartbeats import Heartbeats
from controlplane.metrics import Metrics
from controlplane.outage import Outage
from controlplane.planning_files import PlanningFiles
from controlplane.proxy import Proxy
from controlplane.registry import Registry
from controlplane.runs import Runs
from controlplane.settings import ControlPlaneSettings
from controlplane.store_sync import StoreSync


@dataclass
class Services:
    """Everything one control-plane process holds, built from its settings: the database,
    the token checker, registry, runs, fleet snapshot, metrics, heartbeat writer, the
    store catalog and proxy."""

    settings: ControlPlaneSettings
    engine: Any
    sessions: Any
    tokens: TokenChecker
    registry: Registry
    runs: Runs
    fleet: Fleet
    metrics: Metrics
    heartbeats: Heartbeats
    catalog: Catalog
    outage: Outage
    store_sync: StoreSync
    proxy: Proxy | None = None
    first_admin_token: str | None = None
    version_events: list[asyncio.Event] = field(default_factory=list)
    # Peers reported for bad bytes or stalls, left out of fetch plans for a while.
    suspects: Suspects = field(default_factory=lambda: Suspects(60.0))
    # Versions' claims and indexes, read from the store once, handed out with fetch plans.
    planning_files: PlanningFiles = field(default_factory=lambda: PlanningFiles(0))

    @classmethod
    def build(cls, settings: ControlPlaneSettings) -> Services:
        engine = dbmod.open_engine(settings.db_url)
        sessions = dbmod.session_factory(engine)
        metrics = Metrics()
        registry = Registry(sessions, settings.lease_seconds)
        roots = [r.strip() for r in settings.store_roots.split(",") if r.strip()]
        runs = Runs(sessions, settings.store, roots)
        catalog = Catalog(settings.catalog_ttl_s)
        outage = Outage(registry, settings.default_retry_after_s, settings.outage_grace_s)
        fleet = Fleet(
            registry,
            runs,
            metrics,
            settings.snapshot_refresh_s,
            catalog,
            outage,
            full_read_s=settings.snapshot_full_read_s,
        )
        services: Services
        store_sync = StoreSync(runs, settings.store_sync_s, lambda: services.versions_changed())
        services = cls(
            settings=settings,
            engine=engine,
            sessions=sessions,
            tokens=TokenChecker(sessions, settings.token_cache_s, outage),
            registry=registry,
            runs=runs,
            fleet=fleet,
            metrics=metrics,
            heartbeats=Heartbeats(registry, runs, fleet, outage, metrics),
            catalog=catalog,
            outage=outage,
            store_sync=store_sync,
            suspects=Suspects(settings.peer_suspect_s),
            planning_files=PlanningFiles(
                settings.planning_copies,
                metrics.store_read_bytes.labels("planning").inc,
                max_bytes=settings.planning_relay_max_bytes,
            ),
        )
        return services

    def versions_changed(self, whole: bool = False) -> None:
        """A run's latest version moved (on the event loop): refresh and wake waiters.
        `whole`: read every engine row (another replica's announcement may be a deleted
        row)."""
        self.fleet.mark_dirty(whole)
        self.wake_version_waiters()

    def wake_waiters(self) -> None:
        """Return every waiting long-poll now (on the event loop), to look again."""
        self.fleet.wake_waiters()
        self.wake_version_waiters()

    def wake_version_waiters(self) -> None:
        waiters, self.version_events = self.version_events, []
        for event in waiters:
            event.set()
