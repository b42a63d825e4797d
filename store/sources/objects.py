"""`ObjectSource`: another object store that mirrors the origin's keys, used as a fetch source.

This is how an S3-compatible regional cache, a read replica of the bucket or a shared
folder plugs in: open it with any URL `store.objects` speaks (`s3://...` with its own
endpoint, a folder). Its bytes are verified like a peer's, so a stale or damaged mirror
can slow a catch-up but never corrupt it. Never writes to the mirror.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from store.errors import StorageUnavailable
from store.objects import ObjectStore, open_objects
from store.sources.base import FetchSource, SourceFailed


class ObjectSource(FetchSource):
    """Reads keys from an `ObjectStore` (a mirror of the origin, same layout)."""

    kind = "objects"

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.location = objects.url

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None) -> ObjectSource:
        return cls(open_objects(url, storage_options))

    def fetch(
        self,
        key: str,
        size: int,
        sink: Callable[[bytes], None] | None = None,
        offset: int = 0,
    ) -> bytes:
        try:
            data = (
                self.objects.get_range(key, offset, size - offset)
                if offset
                else self.objects.get(key)
            )
        except StorageUnavailable as exc:
            raise SourceFailed(
                f"{self.location} did not deliver {key}: {exc}", "unavailable"
            ) from exc
        if sink is not None:
            sink(data)
        return data
