"""Adapters that hold a store's bytes, chosen by URL: a path or file://, memory://, s3://.

`open_objects` is the only factory; it must never import an adapter's optional dependency
(boto3) unless that adapter is asked for.
"""

from __future__ import annotations

from typing import Any

from store.errors import InvalidName
from store.objects.base import Cell, Listing, ObjectStore

__all__ = ["Cell", "Listing", "ObjectStore", "open_objects"]

SUPPORTED = "a folder path, file://PATH, memory://NAME or s3://BUCKET/PREFIX"


def open_objects(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    """Open the adapter for `url`; raise `InvalidName` for a scheme Tether does not speak."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidName(f"store URL {url!r} is empty; use {SUPPORTED}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    options = dict(storage_options or {})
    if scheme == "file":
        from store.objects.local import LocalObjects

        return LocalObjects(rest)
    if scheme == "memory":
        from store.objects.memory import MemoryObjects

        return MemoryObjects(rest)
    if scheme == "s3":
        from store.objects.s3 import S3Objects

        return S3Objects(rest, options)
    raise InvalidName(
        f"store URL {url!r} has scheme {scheme!r}, which is not supported; use {SUPPORTED}"
    )
