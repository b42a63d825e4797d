"""Reading a version's files lazily, through an optional local cache folder.

`VersionFiles` is the `Mapping[str, bytes]` the codecs decode from: a file is fetched from
the store the first time it is asked for. With a cache folder, each fetched file is kept
there beside a sidecar holding its size and xxh3-128 digest; a cached file is used only if
it still matches both (a damaged cache entry is dropped and fetched again). Versions are
immutable, so a verified cache entry never goes stale. Safetensors headers can be read with
two small ranged reads instead of fetching a whole shard. With a `SourcedFetch` and the
digests the store recorded, a file missing from the cache is first asked of the other fetch
sources (peers, a distributor) and only then of the store. This module never writes to the
store.
"""

from __future__ import annotations

import logging
import os
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from store.checksum import tensor_checksum
from store.errors import CorruptPayload, VersionNotFound
from store.layout import version_file_key
from store.objects import ObjectStore
from store.safetensors_io import read_header
from store.sources.sourced_fetch import FileDigest, SourcedFetch
from store.types import VersionRef

log = logging.getLogger(__name__)

_SIDECAR = ".xxh3"
# Small files (the index) are kept in memory once read; shards are not, to bound memory.
_MEMO_LIMIT = 1 << 20


class FileCache:
    """A folder of verified copies of store objects, keyed like the store."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        # Called with the key once a file is saved (from the saving thread): a peer server
        # waiting for that file answers then.
        self.on_saved: Callable[[str], None] | None = None

    def _paths(self, key: str) -> tuple[Path, Path]:
        path = self.root / key
        return path, path.with_name(path.name + _SIDECAR)

    def load(self, key: str, expected_size: int | None = None) -> bytes | None:
        """The cached bytes of `key` if present and intact, else None (damage is dropped)."""
        path, sidecar = self._paths(key)
        try:
            data = path.read_bytes()
            size_text, digest = sidecar.read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        intact = len(data) == int(size_text) and tensor_checksum(data) == digest
        if intact and (expected_size is None or expected_size == len(data)):
            return data
        log.warning("cache entry %s is damaged or stale; fetching it again", path)
        path.unlink(missing_ok=True)
        sidecar.unlink(missing_ok=True)
        return None

    def save(self, key: str, data: bytes) -> None:
        """Keep `data` for `key`: the bytes first, then the sidecar that vouches for them."""
        path, sidecar = self._paths(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, content in ((path, data), (sidecar, f"{len(data)} {tensor_checksum(data)}")):
            temp = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
            try:
                temp.write_bytes(content if isinstance(content, bytes) else content.encode())
                os.replace(temp, target)
            except OSError:
                temp.unlink(missing_ok=True)  # e.g. a full disk: leave nothing half-written
                raise
        if self.on_saved is not None:
            self.on_saved(key)

    def path(self, key: str) -> Path | None:
        """Where the verified copy of `key` lies, if the cache holds one (its sidecar, written
        after the bytes, vouches for it)."""
        path, sidecar = self._paths(key)
        return path if sidecar.exists() and path.exists() else None

    def has(self, key: str) -> bool:
        return self._paths(key)[1].exists()


class VersionFiles(Mapping[str, bytes]):
    """The files of one version (index and shards), fetched on first access."""

    def __init__(
        self,
        objects: ObjectStore,
        ref: VersionRef,
        sizes: Mapping[str, int],
        cache: FileCache | None = None,
        sources: SourcedFetch | None = None,
        digests: Mapping[str, FileDigest] | None = None,
    ) -> None:
        self.objects = objects
        self.ref = ref
        self.sizes = dict(sizes)
        self.cache = cache
        self.sources = sources
        # Only files whose digest the store recorded may come from another source.
        self.digests = dict(digests or {})
        self._memo: dict[str, bytes] = {}
        # Bytes read from the origin store (other sources count theirs in `sources`).
        self.bytes_fetched = 0

    def __getitem__(self, name: str) -> bytes:
        if name not in self.sizes:
            raise KeyError(name)
        if name in self._memo:
            return self._memo[name]
        key = version_file_key(self.ref, name)
        data = self.cache.load(key, self.sizes[name]) if self.cache else None
        if data is None:
            data = self._fetch(key, name)
            if self.cache:
                try:
                    self.cache.save(key, data)
                except OSError as exc:  # a cache that cannot write never fails a read
                    log.warning("could not keep %s in the cache %s: %s", key, self.cache.root, exc)
        if len(data) <= _MEMO_LIMIT:
            self._memo[name] = data
        return data

    def _fetch(self, key: str, name: str) -> bytes:
        expected = self.digests.get(name)
        if self.sources is not None and expected is not None and expected.size == self.sizes[name]:
            data = self.sources.fetch(key, expected)
            if data is not None:
                return data
        try:
            data = self.objects.get(key)
        except FileNotFoundError:
            raise VersionNotFound(
                f"{self.ref.identity}/{name} disappeared from {self.objects.url} while being "
                "read (deleted by gc?); plan the catch-up again"
            ) from None
        if len(data) != self.sizes[name]:
            raise CorruptPayload(
                f"{self.ref.identity}/{name}: expected {self.sizes[name]} bytes, fetched "
                f"{len(data)}; the object changed or the transfer was cut, fetch it again"
            )
        self.bytes_fetched += len(data)
        if self.sources is not None:
            self.sources.count_origin(len(data))
        return data

    def fetch_all(self) -> int:
        """Fetch every file now and hold it in memory; return the bytes held."""
        for name in self.sizes:
            self._memo[name] = self[name]
        return sum(len(data) for data in self._memo.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def is_cached(self, name: str) -> bool:
        return self.cache is not None and self.cache.has(version_file_key(self.ref, name))

    def header(self, name: str) -> dict[str, Any]:
        """A shard's safetensors header, by two ranged reads (or from the cache)."""
        if name in self._memo or self.is_cached(name):
            return read_header(self[name])[0]
        key = version_file_key(self.ref, name)
        prefix = self.objects.get_range(key, 0, 8)
        if len(prefix) < 8:
            raise CorruptPayload(
                f"{self.ref.identity}/{name} is {len(prefix)} bytes: too short for a "
                "safetensors header; the file is truncated"
            )
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > self.sizes[name]:
            raise CorruptPayload(
                f"{self.ref.identity}/{name} claims a {length}-byte header but holds only "
                f"{self.sizes[name]} bytes; the file is truncated or not safetensors"
            )
        return read_header(prefix + self.objects.get_range(key, 8, length))[0]
