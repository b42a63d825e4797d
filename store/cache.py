"""Reading a version's files lazily, through an optional local cache folder.

`VersionFiles` is the `Mapping[str, bytes]` the codecs decode from: a file is fetched from
the store the first time it is asked for. With a cache folder, each fetched file is kept
there beside a sidecar holding its size and xxh3-128 digest; a cached file is used only if
it still matches both (a damaged cache entry is dropped and fetched again). Versions are
immutable, so a verified cache entry never goes stale. Safetensors headers can be read with
two small ranged reads instead of fetching a whole shard. With a `SourcedFetch` and the
digests the store recorded, a file missing from the cache is first asked of the other fetch
sources (peers, a distributor) and only then of the store. When the cache serves peers
(`FileCache.streams`), each such file is also registered as a `PartialFile` while it arrives
(read from the store in ranges of `chunk_bytes`), so peers can be sent its first bytes
before the last have come in (cut-through forwarding; `store.partial_file`). This module
never writes to the store.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import struct
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from store.checksum import tensor_checksum
from store.errors import CorruptPayload, VersionNotFound
from store.layout import version_file_key
from store.objects import ObjectStore
from store.partial_file import FAILED, RECEIVING, VERIFIED, PartialFile
from store.safetensors_io import read_header
from store.sources.sourced_fetch import FileDigest, Held, SourcedFetch
from store.types import VersionRef

log = logging.getLogger(__name__)

_SIDECAR = ".xxh3"
_SHARD_SUFFIX = ".safetensors"
# Small files (the index) are kept in memory once read; shards are not, to bound memory.
_MEMO_LIMIT = 1 << 20


def fetch_versions(
    versions: Sequence[VersionFiles], fetched: Callable[[int], None] | None = None
) -> None:
    """Fetch every file of `versions` (a catch-up's chain, in order) now and hold it in
    memory; `fetched(i)` hears, in order, that every file of `versions[i]` is held (from the
    thread that fetched its last file).

    With a fetch plan of several lanes, one worker per lane takes that lane's files of every
    version in turn, the chain's first version first and each version's index before its
    shards: each file comes from its lane's parent, whose upload is shared by its children,
    and a lane never fetches two files at once (a worker that finished its own lane's files
    of a version and took the other lane's next one split that parent's upload further).
    Nor does a lane wait for the other lanes to finish a version before it starts the next:
    the versions were fetched one after the other, and in a 30-engine cold start on capped
    links each version ended with one lane idle while the other fetched its last shard and
    then the index. Without lanes, one file at a time."""
    queues: dict[int, list[tuple[int, str]]] = {}
    for index, files in enumerate(versions):
        for lane, name in files.queued():
            queues.setdefault(lane, []).append((index, name))
    left = [len(files.sizes) for files in versions]
    reported = 0
    lock = threading.Lock()

    def report() -> None:
        nonlocal reported
        while reported < len(left) and left[reported] == 0:
            if fetched is not None:
                fetched(reported)
            reported += 1

    failed = threading.Event()

    def fetch(queue: list[tuple[int, str]]) -> None:
        for index, name in queue:
            if failed.is_set():
                return  # another lane failed: the catch-up fails with its error
            try:
                versions[index].hold_fetched(name)
            except BaseException:
                failed.set()
                raise
            with lock:
                left[index] -= 1
                report()

    # The calling thread takes the first lane; only the others get threads of their own.
    first, *others = queues.values() or [[]]
    if not others:
        fetch(first)
    else:
        with concurrent.futures.ThreadPoolExecutor(len(others)) as pool:
            futures = [pool.submit(fetch, queue) for queue in others]
            fetch(first)  # on failure the others stop at their next file, and are waited for
            for future in futures:
                future.result()
    with lock:
        report()  # versions without files


_MAX_KEY_PATHS = 4096


class FileCache:
    """A folder of verified copies of store objects, keyed like the store."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        # Called with the key once a file is saved (from the saving thread): a peer server
        # waiting for that file answers then.
        self.on_saved: Callable[[str], None] | None = None
        # Set by whoever serves the cache to peers: files are then readable while they
        # arrive (`partial`), and the store is read in ranges of `chunk_bytes` so that its
        # bytes arrive in pieces too. `on_receiving` hears the key as a file starts to arrive.
        self.streams = False
        self.chunk_bytes = 64 << 20
        self.on_receiving: Callable[[str], None] | None = None
        self._partials: dict[str, PartialFile] = {}
        self._partials_lock = threading.Lock()
        # Each key's two paths, built once: a peer server looks a file up per GET, and
        # pathlib's joins were ~5 % of a 1,000-agent swarm's CPU.
        self._key_paths: dict[str, tuple[Path, Path]] = {}

    def _paths(self, key: str) -> tuple[Path, Path]:
        paths = self._key_paths.get(key)
        if paths is None:
            path = self.root / key
            paths = path, path.with_name(path.name + _SIDECAR)
            if len(self._key_paths) >= _MAX_KEY_PATHS:
                self._key_paths.clear()
            self._key_paths[key] = paths
        return paths

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

    # ---- files on their way in -----------------------------------------------------------

    def receive(self, key: str, size: int) -> PartialFile:
        """Register a new attempt at `key`; readers see it from now on."""
        partial = PartialFile(key, size)
        with self._partials_lock:
            self._partials[key] = partial
        if self.on_receiving is not None:
            self.on_receiving(key)
        return partial

    def partial(self, key: str) -> PartialFile | None:
        """The attempt at `key` under way (or verified and not yet saved), if any."""
        with self._partials_lock:
            partial = self._partials.get(key)
        return partial if partial is not None and partial.state != FAILED else None

    def received(self, key: str) -> None:
        """`key` is saved (or given up): new readers read the file, not the attempt."""
        with self._partials_lock:
            self._partials.pop(key, None)


def _matches(data: bytes, expected: FileDigest) -> bool:
    """Whether `data` is what the origin recorded (size and digest)."""
    return len(data) == expected.size and tensor_checksum(data) == expected.digest


class Attempts:
    """The successive attempts at one file as its readers see them: one `PartialFile` per
    attempt that delivered bytes. An attempt that failed before its first byte (a miss, a
    refusal) does not disturb the readers waiting; one that failed later ends their
    transfers short and the next attempt starts a new `PartialFile`."""

    def __init__(self, cache: FileCache, key: str, size: int) -> None:
        self.cache = cache
        self.key = key
        self.size = size
        self.current: PartialFile | None = None

    def sink(self) -> Callable[[bytes], None]:
        """Where the next attempt writes its bytes as they arrive."""
        if self.current is None or self.current.state != RECEIVING:
            self.current = self.cache.receive(self.key, self.size)
        return self.current.write

    def failed(self) -> None:
        if self.current is not None and self.current.received:
            self.current.failed()
            self.current = None

    def settle(self, data: bytes, expected: FileDigest | None) -> None:
        """The attempt delivered `data`: release it to the readers if it matches the
        origin's record, else end their transfers."""
        if self.current is None:
            return
        if expected is not None and _matches(data, expected):
            self.current.verified()
        else:
            self.current.failed()

    def verified(self) -> None:
        if self.current is not None:
            self.current.verified()

    def abandon(self) -> None:
        """No attempt will follow: end any transfer still waiting for bytes."""
        if self.current is not None and self.current.state not in (VERIFIED, FAILED):
            self.current.failed()


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
        # Each file's place among those the claim records: every engine deals the same file
        # to the same lane of its fetch plan.
        self._place = {name: i for i, name in enumerate(sorted(self.digests))}
        self._memo: dict[str, bytes] = {}
        # Bytes read from the origin store (other sources count theirs in `sources`).
        self.bytes_fetched = 0
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> bytes:
        if name not in self.sizes:
            raise KeyError(name)
        if name in self._memo:
            return self._memo[name]
        key = version_file_key(self.ref, name)
        data = self.cache.load(key, self.sizes[name]) if self.cache else None
        if data is None:
            data = self._fetch(key, name)
            self._keep(key, data)
        if len(data) <= _MEMO_LIMIT:
            self._memo[name] = data
        return data

    def _keep(self, key: str, data: bytes) -> None:
        """Keep verified `data` in the cache, if any (where peers are served from)."""
        if self.cache:
            try:
                self.cache.save(key, data)
            except OSError as exc:  # a cache that cannot write never fails a read
                log.warning("could not keep %s in the cache %s: %s", key, self.cache.root, exc)
            finally:
                self.cache.received(key)

    def _fetch(self, key: str, name: str) -> bytes:
        expected = self.digests.get(name)
        if expected is not None and expected.size != self.sizes[name]:
            expected = None
        # Peers may read a file as it arrives only if they can verify it (it has a digest).
        attempts = (
            Attempts(self.cache, key, self.sizes[name])
            if self.cache is not None and self.cache.streams and expected is not None
            else None
        )
        try:
            return self._fetch_from(key, name, expected, attempts)
        finally:
            if attempts is not None:
                attempts.abandon()

    def _fetch_from(
        self, key: str, name: str, expected: FileDigest | None, attempts: Attempts | None
    ) -> bytes:
        held = Held()
        if self.sources is not None and expected is not None:
            data = self.sources.fetch(
                key, expected, attempts, lane=self._place[name], held=held,
                version=self.ref.version,
            )  # fmt: skip
            if data is not None:
                return data
        try:
            # From where the sources stopped: readers of the file read on.
            start = held.size
            data = b"".join(
                [*held.chunks, self._read_origin(key, self.sizes[name], attempts, start)]
            )
            if start and expected is not None and not _matches(data, expected):
                # The sources' part was wrong (a lying peer that then failed): the origin's
                # bytes only, and readers start over.
                log.warning("%s: the sources' first %d bytes did not match; reading the "
                            "whole file from the store", key, start)  # fmt: skip
                if attempts is not None:
                    attempts.failed()
                if self.sources is not None:
                    self.sources.reject(len(data))
                held = Held()
                data = self._read_origin(key, self.sizes[name], attempts, 0)
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
        if attempts is not None:
            attempts.settle(data, expected)
        origin_bytes = len(data) - held.size
        with self._lock:
            self.bytes_fetched += origin_bytes
        if self.sources is not None:
            self.sources.count_origin(origin_bytes, held)
        return data

    def _read_origin(
        self, key: str, size: int, attempts: Attempts | None, offset: int = 0
    ) -> bytes:
        """The object from the origin store from byte `offset` on; in ranges, each passed
        on as it arrives, when peers may be reading it."""
        if attempts is None:
            return self._origin_tail(key, size, offset)
        sink = attempts.sink()
        chunk = max(1, self.cache.chunk_bytes if self.cache is not None else size)
        if size - offset <= chunk:
            data = self._origin_tail(key, size, offset)
            sink(data)
            return data
        parts = []
        while offset < size:
            piece = self.objects.get_range(key, offset, min(chunk, size - offset))
            if not piece:
                break  # shorter than listed: the caller's size check says so
            sink(piece)
            parts.append(piece)
            offset += len(piece)
        return b"".join(parts)

    def _origin_tail(self, key: str, size: int, offset: int) -> bytes:
        """Bytes `offset` to the end of the origin's object (one read)."""
        return (
            self.objects.get_range(key, offset, size - offset) if offset else self.objects.get(key)
        )

    def hold(self, name: str, data: bytes) -> None:
        """Use `data` as the file `name` without fetching it (the caller checked it against
        the version's claim); kept in the cache like a fetched file, so peers that ask
        for it are served."""
        if name not in self.sizes or len(data) != self.sizes[name]:
            raise CorruptPayload(
                f"{self.ref.identity}/{name}: {len(data)} bytes given, the version lists "
                f"{self.sizes.get(name)}"
            )
        self._memo[name] = data
        self._keep(version_file_key(self.ref, name), data)

    def fetch_all(self) -> int:
        """Fetch every file now and hold it in memory; return the bytes held (see
        `fetch_versions`)."""
        fetch_versions([self])
        return sum(len(data) for data in self._memo.values())

    def queued(self) -> list[tuple[int, str]]:
        """(lane, name) of every file, in the order they are fetched: files that are not
        shards (the index) first, then by place. Without lanes, or for a file with no place
        (no digest: from the store only), the lane is -1."""
        lanes = self.sources.lanes if self.sources is not None and self.digests else 0
        names = sorted(
            self.sizes,
            key=lambda name: (
                name.endswith(_SHARD_SUFFIX), self._place.get(name, len(self._place)), name
            ),
        )  # fmt: skip
        return [
            (self._place[name] % lanes if lanes > 1 and name in self._place else -1, name)
            for name in names
        ]

    def hold_fetched(self, name: str) -> None:
        """Fetch `name` now (if it is not held yet) and hold it in memory."""
        self._memo[name] = self[name]

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
