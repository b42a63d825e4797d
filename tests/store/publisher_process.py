"""A publisher in its own process, driven by a test over stdin/stdout.

    python -m tests.store.publisher_process '<json>'

The JSON names the store (`url`, `options`), the `run_id`, `version`, `seed` of the
checkpoint it publishes as FULL, the `expected` pointer version (or null), and `pause_after`:
if set, the publisher stops just before its N-th object write, prints "paused" and blocks
until it is killed. Otherwise it prints "ready", waits for a "go" line, publishes and prints
"won" or "conflict". Tests use it to race publishers and to kill one mid-upload.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from store.codecs import encode_version
from store.errors import PointerConflict
from store.store import Store
from store.synthetic import random_checkpoint
from store.types import VersionRef


class PauseBeforePut:
    """Wraps a store's objects: the `limit`-th put announces itself and never returns."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner = inner
        self.limit = limit
        self.puts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, key: str, data: bytes) -> None:
        self.puts += 1
        if self.puts == self.limit:
            print("paused", flush=True)
            threading.Event().wait()  # until SIGKILL
        self.inner.put(key, data)


def main(spec: dict[str, Any]) -> int:
    store = Store(spec["url"], storage_options=spec.get("options") or {})
    ref = VersionRef(spec["run_id"], spec["version"])
    files = encode_version(
        random_checkpoint(seed=spec["seed"]),
        None,
        version=ref.version,
        base_version=None,
        codec="full",
        shard_bytes=spec.get("shard_bytes", 16_384),
    )
    expected = spec.get("expected")
    expected_ref = None if expected is None else VersionRef(ref.run_id, expected)
    if spec.get("pause_after"):
        store.objects = PauseBeforePut(store.objects, spec["pause_after"])  # type: ignore[assignment]
        store.publish(ref, files, expected=expected_ref)
        return 1  # unreachable unless the pause never came
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    try:
        store.publish(ref, files, expected=expected_ref)
    except PointerConflict as exc:
        print(f"conflict {exc}", flush=True)
        return 3
    print("won", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
