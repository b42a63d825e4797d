"""`AgentStatus`: what one engine agent reports about itself, in one place.

The reconciler and the engine monitor write it; the heartbeat, `/health` and `/server_info`
read it. Owns the rule that turns the facts into a `SyncState`:

- `error` while the engine does not answer or after a failed commit (out of routing);
- `booting` until the first catch-up has finished (out of routing, `/health` 503);
- `syncing` while a newer version is staged (still serving `applied_version`);
- `ready` otherwise.

Must never do I/O.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from wire import MAX_INT, FetchReport, Heartbeat, SyncState


@dataclass
class PassTimings:
    """Seconds spent in each step of one reconcile pass (0 for steps it skipped)."""

    target: int
    base: int | None = None
    fetch_s: float = 0.0
    fold_verify_s: float = 0.0
    convert_s: float = 0.0
    write_s: float = 0.0
    stage_s: float = 0.0
    drain_s: float = 0.0
    pause_s: float = 0.0
    commit_s: float = 0.0
    # Version-file bytes this pass took, by source ("store", "peer", "http", "objects").
    bytes_from: dict[str, int] = field(default_factory=dict)
    restaged_for: int | None = None
    committed: int | None = None  # the version this pass put on the engine (after a restage: newer)
    outcome: str = "running"
    finished_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class AgentStatus:
    """Mutable facts about one agent and its engine (event loop and staging threads)."""

    applied_version: int | None = None
    caught_up: bool = False
    staging_target: int | None = None
    staging_progress: float = 0.0
    last_error: str | None = None
    engine_reachable: bool = True
    terminal: bool = False
    passes: deque[PassTimings] = field(default_factory=lambda: deque(maxlen=8))
    # Failed reconcile passes by error type (StageFailed, StoreError, EngineUnreachable...).
    failures: Counter[str] = field(default_factory=Counter)
    started_at: float = field(default_factory=time.time)
    # Peer-assisted fetch: version-file bytes taken by source, sources dropped by reason
    # (`digest`, `size`, `stall`, `error`, `unavailable`), bytes received from a source and
    # thrown away unverified, and what this agent served to its peers.
    fetched_bytes: Counter[str] = field(default_factory=Counter)
    source_faults: Counter[str] = field(default_factory=Counter)
    rejected_bytes: int = 0
    served_bytes: int = 0
    served_files: int = 0
    # Seconds `store.codecs.warm` took at boot; None: not warmed (off, or it failed).
    codecs_warmed_s: float | None = None
    # Seconds `engine_agent.precision.warm` took at boot (0 for bf16); None: not warmed.
    conversion_warmed_s: float | None = None

    @property
    def sync_state(self) -> SyncState:
        if self.terminal or not self.engine_reachable:
            return SyncState.ERROR
        if not self.caught_up:
            return SyncState.BOOTING
        if self.staging_target is not None:
            return SyncState.SYNCING
        return SyncState.READY

    @property
    def healthy(self) -> bool:
        return self.sync_state in (SyncState.READY, SyncState.SYNCING)

    def heartbeat(self, in_flight: int) -> Heartbeat:
        return Heartbeat(
            applied_version=self.applied_version,
            sync_state=self.sync_state,
            staging_target=self.staging_target,
            staging_progress=min(max(self.staging_progress, 0.0), 1.0),
            in_flight=in_flight,
            last_error=self.last_error[:4000] if self.last_error else None,
            fetched=self.fetch_report(),
        )

    def fetch_report(self) -> FetchReport | None:
        """Where the last committed version's bytes came from (store, or any other source),
        for the control plane's convergence figures; None without that accounting."""
        last = next((p for p in reversed(self.passes) if p.committed is not None), None)
        if last is None or last.committed is None or not last.bytes_from:
            return None
        store = last.bytes_from.get("store", 0)
        others = sum(size for source, size in last.bytes_from.items() if source != "store")
        return FetchReport(
            version=last.committed,
            store_bytes=min(store, MAX_INT),
            peer_bytes=min(others, MAX_INT),
        )
