"""Which versions of each run the store still holds (`store gc` deletes old ones).

Owns a per-run cache of the store's complete versions, re-listed after `ttl_s` seconds, or
at once when a caller needs a version no listing was asked about yet: each version is
checked by a listing taken after it was first needed (so a pin is never placed on the
word of an older listing), while a stream of requests for one version costs one listing
per `ttl_s`, not one per request.
The control plane's `versions` table remembers what was published; this says what can
still be fetched. Blocking (it lists the store): call it off the event loop. Never writes
to the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection

from controlplane.pointer import open_store

log = logging.getLogger(__name__)


class Catalog:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # run → (when listed, the versions found, the versions asked about at that time)
        self._seen: dict[str, tuple[float, frozenset[int], frozenset[int]]] = {}
        self._lock = threading.Lock()
        # run → when listing it last failed (runs never listed successfully)
        self._unreadable: dict[str, float] = {}

    def versions(
        self, run_id: str, store_url: str, need: Collection[int] = ()
    ) -> frozenset[int] | None:
        """The run's complete versions in the store; None when the store cannot be read
        and nothing was listed before (callers then treat every version as present)."""
        now = time.monotonic()
        with self._lock:
            entry = self._seen.get(run_id)
        if entry is not None and now - entry[0] < self.ttl_s:
            _listed, found, asked = entry
            if all(v in asked for v in need):
                return found
        if entry is None and now - self._unreadable.get(run_id, -self.ttl_s) < self.ttl_s:
            return None
        try:
            found = frozenset(open_store(store_url).list_versions(run_id))
        except Exception as exc:
            # Not again before `ttl_s`: a store that is away must not slow every snapshot.
            log.warning("cannot list the versions of run %s in %s: %r", run_id, store_url, exc)
            with self._lock:
                if entry is not None:
                    self._seen[run_id] = (now, entry[1], entry[2] | frozenset(need))
                else:
                    self._unreadable[run_id] = now
            return entry[1] if entry is not None else None
        with self._lock:
            self._seen[run_id] = (
                now,
                found,
                frozenset(need) | (entry[2] if entry else frozenset()),
            )
        return found
