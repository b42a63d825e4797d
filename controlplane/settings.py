"""The control plane's one settings object, read from flags and `TETHER_*` variables.

Owns configuration only; it opens no database and starts nothing.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ControlPlaneSettings(BaseSettings):
    """Every knob of one control-plane process (`TETHER_DB_URL`, `TETHER_STORE`, ...)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_", extra="ignore")

    db_url: str = "sqlite:///./.tether/controlplane.db"
    store: str = "./.tether/store"
    admin_token: str | None = Field(default=None, repr=False)
    host: str = "127.0.0.1"
    port: int = 8700
    lease_seconds: float = Field(default=10.0, gt=0)
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    # The hot lane (generate routes, heartbeats, target long-polls) answered by the
    # server's own exchange instead of an ASGI cycle (`hot_exchange.py`); off: the ASGI
    # entry, same answers.
    hot_exchange: bool = True
    # Once serving, freeze the objects that exist and collect cycles rarely
    # (`runtime/collector.py`); off: CPython's defaults (full collections of every
    # object every few seconds under load, each holding every request).
    gc_settle: bool = True
    # All request headers together (431 past it; the HTTP parser is capped just above).
    max_header_bytes: int = Field(default=64 * 1024, gt=0)
    # One streamed answer relayed by the router; past it the stream ends with an error event.
    max_stream_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # A requested version more than this far above the run's latest is refused (422) as a
    # mistake: no plausible wait is that many publishes long.
    max_versions_ahead: int = Field(default=1000, ge=0)
    # Where runs' store URLs may point: comma-separated folders or URL prefixes
    # (file:// folders, s3://bucket/prefix). Empty: only under `store`.
    store_roots: str = ""
    # How long a listing of a run's versions in the store is reused.
    catalog_ttl_s: float = Field(default=5.0, gt=0)
    # On SIGTERM, open requests (long-polls, streams) get this long before they are cut.
    shutdown_grace_s: float = Field(default=2.0, ge=0)
    # How stale the in-process fleet snapshot may get before it is reloaded from the DB.
    snapshot_refresh_s: float = Field(default=0.5, gt=0)
    # Those reloads read only the engine rows written since the previous one; every row is
    # read at least this often (and after any announced change: see controlplane/fleet.py).
    snapshot_full_read_s: float = Field(default=10.0, gt=0)
    # Long-polls re-check the shared DB this often, so they work across replicas.
    poll_interval_s: float = Field(default=0.25, gt=0)
    max_long_poll_s: float = Field(default=60.0, gt=0)
    token_cache_s: float = Field(default=1.0, ge=0)
    route_attempts: int = Field(default=3, ge=1)
    # How long a client may reuse a `GET /v1/routes` candidate set (`valid_for_s`): short,
    # so an engine that left or moved version stops getting direct traffic soon after.
    route_set_valid_s: float = Field(default=1.0, gt=0, le=60)
    proxy_timeout_s: float = Field(default=600.0, gt=0)
    default_retry_after_s: float = Field(default=1.0, gt=0)
    # How often every run's store pointer is compared with its recorded latest version (a
    # version published while the control plane was down, or never notified, is adopted).
    store_sync_s: float = Field(default=5.0, gt=0)
    # While the database is away: how long the router keeps routing on its last fleet view
    # (leases do not lapse meanwhile) and accepts tokens by their last known role.
    outage_grace_s: float = Field(default=60.0, ge=0)
    # Agent sessions (`controlplane/chat_sessions.py`): how long one lives after its last
    # turn unless its create body says, and how many this process keeps in memory (the
    # database holds them all; a session out of memory is read back on its next turn).
    session_ttl_s: float = Field(default=3600.0, gt=0)
    session_cache: int = Field(default=1000, ge=1)
    # Peer-assisted fetch (controlplane/fetch_plan.py): the tree's fan-out (children per
    # peer), how many peers one plan names (nearest ancestors first; the store comes after
    # them; 0 turns peer fetch off fleet-wide) and how long a reported peer is left out.
    # Peers forward files as they arrive, so a deeper tree costs little; a peer's upload is
    # shared by its children, so each child receives at 1/fanout of it: 2, not more.
    peer_fanout: int = Field(default=2, ge=1)
    peer_plan_size: int = Field(default=3, ge=0)
    peer_suspect_s: float = Field(default=60.0, ge=0)
    # Versions whose claim and index the control plane keeps to hand out with fetch plans
    # (controlplane/planning_files.py); 0: engines read them from the store themselves.
    planning_copies: int = Field(default=64, ge=0)
    # The most bytes of claims and indexes one fetch plan carries (the version's own, then
    # earlier ones, oldest first, while they fit). A version whose own exceed it is not
    # relayed at all: a model of ~100k tensors has an index of megabytes, which a fleet
    # reads from the store (built to serve bytes to many) rather than through this process.
    planning_relay_max_bytes: int = Field(default=1 << 20, ge=0)
