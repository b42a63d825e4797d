"""The control plane's copy of each version's planning files (claim and index).

Every engine of a fleet plans and verifies a catch-up from the version's `.tether-claim`
and index. Read by each engine from the store they cost a few hundred bytes of store egress
per engine per version, which grows with the fleet; read here once per version and handed
out with the fetch plan (`FetchPlan.planning`, docs/peers.md), the store serves them once
per control-plane replica whatever the fleet's size.

Owns reading those two objects (once per version, however many engines ask at the same
moment) and keeping the last `size` versions' copies. Versions are immutable, so a copy
never goes stale. Asked only for versions at or below a run's recorded latest, which the
store's pointer has reached (so they are complete). Never writes to the store; a store
that cannot be read means no copy (the engines read the store themselves), never an error;
nor is a version whose claim and index together exceed `max_bytes` relayed (kept as no
copy, so read once): for those a fleet reads the store, which serves bytes to many better
than one process does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

from controlplane.pointer import open_store
from store.errors import CorruptPayload
from store.layout import CLAIM_FILENAME, version_file_key
from store.manifest import INDEX_FILENAME
from store.relayed import RelayedVersion
from store.types import VersionRef
from wire.peers import PlanningFiles as PlanningFilesBody

log = logging.getLogger(__name__)

Key = tuple[str, str, int]


class PlanningFiles:
    """Claims and indexes of recent versions, read from the store once each."""

    def __init__(
        self, size: int, on_read: Callable[[int], None] = lambda n: None, max_bytes: int = 1 << 20
    ) -> None:
        self.size = size
        self.on_read = on_read
        self.max_bytes = max_bytes
        self._copies: OrderedDict[Key, PlanningFilesBody | None] = OrderedDict()
        self._reading: dict[Key, asyncio.Task[PlanningFilesBody | None]] = {}

    async def get(self, store_url: str, run_id: str, version: int) -> PlanningFilesBody | None:
        """The version's claim and index (None: the version has no claim, e.g. Stitch
        wrote it, or the store could not be read just now)."""
        if self.size <= 0 or not store_url:
            return None
        key = (store_url, run_id, version)
        if key in self._copies:
            self._copies.move_to_end(key)
            return self._copies[key]
        task = self._reading.get(key)
        if task is None:
            task = asyncio.create_task(self._read(key))
            self._reading[key] = task
            task.add_done_callback(lambda _: self._reading.pop(key, None))
        return await asyncio.shield(task)

    async def _read(self, key: Key) -> PlanningFilesBody | None:
        store_url, run_id, version = key
        try:
            copy = await asyncio.to_thread(self._read_store, store_url, VersionRef(run_id, version))
        except Exception as exc:
            # Not kept: the next engine's plan asks again.
            log.warning("reading the claim and index of %s v%d failed: %r", run_id, version, exc)
            return None
        self._copies[key] = copy
        while len(self._copies) > self.size:
            self._copies.popitem(last=False)
        return copy

    def _read_store(self, store_url: str, ref: VersionRef) -> PlanningFilesBody | None:
        objects = open_store(store_url).objects
        try:
            claim = objects.get(version_file_key(ref, CLAIM_FILENAME))
        except FileNotFoundError:
            return None
        index = objects.get(version_file_key(ref, INDEX_FILENAME))
        self.on_read(len(claim) + len(index))
        if len(claim) + len(index) > self.max_bytes:
            log.info(
                "%s: claim and index are %d bytes, over the %d a plan carries; engines read "
                "them from the store",
                ref, len(claim) + len(index), self.max_bytes,
            )  # fmt: skip
            return None
        try:
            # The engines check the copy the same way; one that fails here is not kept.
            RelayedVersion.check(ref, claim, index)
            return PlanningFilesBody(claim=claim.decode(), index=index.decode())
        except (CorruptPayload, UnicodeDecodeError) as exc:
            log.warning("%s: claim and index not relayed (%s); engines read the store", ref, exc)
            return None
