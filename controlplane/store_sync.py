"""Following the store's pointers, so a version is never lost to the fleet.

Owns the control plane's periodic look at each run's `<run>/latest` in the store: when a
pointer names a version newer than the run's recorded latest (a trainer published while the
control plane was down, or its notification never arrived), the version is recorded as if
it had been notified. Runs once at start and then every `store_sync_s`. Every replica may do
it at the same time: recording a version is idempotent. Never writes to the store and never
decides targets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sqlalchemy.exc import IntegrityError

from controlplane.background import BackgroundTask
from controlplane.pointer import read_pointer
from controlplane.runs import Runs

log = logging.getLogger(__name__)


class StoreSync(BackgroundTask):
    """Records versions the store's pointers name but the database does not know yet."""

    def __init__(self, runs: Runs, interval_s: float, on_advance: Callable[[], None]) -> None:
        super().__init__("store-sync", self._loop)
        self.runs = runs
        self.interval_s = interval_s
        self.on_advance = on_advance

    def sync_once(self) -> dict[str, int]:
        """Record every pointer that moved past its run's latest; {run: version} recorded.
        Blocking: call it in a worker thread."""
        advanced: dict[str, int] = {}
        for run in self.runs.all():
            try:
                ref = read_pointer(run.store_url, run.run_id)
            except Exception as exc:
                # One unreadable store (gone, refusing, misconfigured) must not hold up
                # the other runs.
                log.warning("reading the pointer of run %s failed: %r", run.run_id, exc)
                continue
            if ref is None or (
                run.latest_version is not None and ref.version <= run.latest_version
            ):
                continue
            try:
                self.runs.record_version(run.run_id, ref.version, None, ref.version)
            except IntegrityError:
                continue  # another replica recorded it at the same moment
            log.info(
                "run %s: the store's pointer names v%d (recorded latest v%s); following it",
                run.run_id,
                ref.version,
                run.latest_version,
            )
            advanced[run.run_id] = ref.version
        return advanced

    async def _loop(self) -> None:
        while True:
            try:
                if await asyncio.to_thread(self.sync_once):
                    self.on_advance()
            except Exception as exc:
                # The database or a store is away; the next round tries again.
                log.warning("following the store's pointers failed: %r", exc)
            await asyncio.sleep(self.interval_s)
