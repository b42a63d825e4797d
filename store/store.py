"""`Store`: the source of truth for a run's policy versions, over any supported URL.

The control plane, the publisher and the engine agent all go through this class. It owns
the publish protocol and the read side; the bytes live behind an `ObjectStore` adapter
(a folder, memory, S3) and the version formats belong to `store.codecs`.

Invariants, and why they hold:

- A reader never sees the pointer name incomplete bytes. `publish` writes every file, reads
  each one back and checks its size and xxh3-128 digest, and only then moves `latest` by
  compare-and-swap; `move_pointer` refuses a version whose index or shards are missing.
- The pointer only moves forward within a run, and never below the run's boot version
  (`decide_pointer_move`, checked before any byte is written and again atomically).
- Versions are immutable. A publisher first claims the version number with a create-only
  `.tether-claim` object holding the digest of its files; a different claim means another
  publisher owns the number (`PointerConflict`), a complete version is never rewritten
  (`AlreadyExists`). A retry with identical bytes (after a crash) proceeds.
- Every key is validated (`store.layout`) before anything is written.

Why about 600 lines: `Store` is the one facade of the store protocol (publish, read, verify,
catch-up, retention); each rule it applies already lives in its own module (`layout`,
`pointer`, `codecs`, `catchup`, `retention`, `encoder`) and this class only sequences them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from store.cache import FileCache, VersionFiles, fetch_versions
from store.catchup import CatchUpPlan, plan_catch_up
from store.checksum import tensor_checksum
from store.errors import (
    AlreadyExists,
    ChecksumMismatch,
    CorruptPayload,
    InvalidName,
    InvalidVersion,
    PointerConflict,
    StoreError,
    VersionNotFound,
)
from store.layout import (
    CLAIM_FILENAME,
    run_key,
    updates_prefix,
    validate_file_name,
    version_file_key,
    version_prefix,
)
from store.manifest import INDEX_FILENAME, Manifest
from store.objects import ObjectStore, open_objects
from store.pointer import READ_NOW, Expected, Pointer
from store.relayed import RelayedVersion
from store.retention import GcReport, versions_to_keep
from store.run_metadata import RunMetadata
from store.safetensors_io import load as load_safetensors
from store.sources.sourced_fetch import FileDigest, SourcedFetch
from store.tensors import RawTensor
from store.types import (
    VersionKind,
    VersionRef,
    parse_version_dir_name,
    validate_run_id,
    validate_version,
)

log = logging.getLogger(__name__)

# progress(done, total, what): called as catch-up and verification advance.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class PublishReceipt:
    """What one publish did and how long each phase took (seconds)."""

    ref: VersionRef
    previous: VersionRef | None
    bytes_written: int
    write_s: float
    verify_s: float
    cas_s: float


@dataclass(frozen=True)
class WriteReceipt:
    """What `write_version` wrote and verified."""

    ref: VersionRef
    bytes_written: int
    write_s: float
    verify_s: float


@dataclass(frozen=True)
class StoredVersion:
    """One version folder as listed: its manifest (None if the index is missing) and files."""

    ref: VersionRef
    manifest: Manifest | None
    sizes: dict[str, int]
    complete: bool

    @property
    def kind(self) -> VersionKind | None:
        return self.manifest.kind if self.manifest else None

    @property
    def base_version(self) -> int | None:
        return self.manifest.base_version if self.manifest else None

    @property
    def bytes(self) -> int:
        return sum(size for name, size in self.sizes.items() if name != CLAIM_FILENAME)

    @property
    def version_files(self) -> dict[str, int]:
        """Index and shard sizes (what a reader fetches), when complete."""
        if not self.manifest:
            return {}
        names = [INDEX_FILENAME, *self.manifest.shard_files()]
        return {name: self.sizes[name] for name in names if name in self.sizes}


@dataclass
class VerifyReport:
    """The outcome of `verify`: what was checked and every problem found."""

    ref: VersionRef
    files_checked: int = 0
    bytes_checked: int = 0
    tensors_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _relayed_info(relayed: RelayedVersion) -> StoredVersion:
    """A relayed version as if listed: complete, because only a version the store's pointer
    has reached is relayed, and the pointer moves only to complete versions."""
    return StoredVersion(
        ref=relayed.ref, manifest=relayed.manifest, sizes=relayed.sizes, complete=True
    )


class CompleteVersions(Collection[int]):
    """A run's complete versions, each looked up when it is asked about.

    A catch-up walks one chain (target back to `have` or an anchor), so it reads those
    versions' indexes only: listing every version of the run would cost each agent a read
    per version of the run's history at every catch-up, which grows with the run (and with
    the fleet, every agent doing it). Iterating (for an error message) lists them all.
    """

    def __init__(
        self, store: Store, run_id: str, relayed: Mapping[int, RelayedVersion] | None = None
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._infos: dict[int, StoredVersion] = {
            version: _relayed_info(copy) for version, copy in (relayed or {}).items()
        }

    def info(self, version: int) -> StoredVersion:
        if version not in self._infos:
            self._infos[version] = self._store._version_info(VersionRef(self._run_id, version))
        return self._infos[version]

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and version >= 0 and self.info(version).complete

    def __iter__(self) -> Iterator[int]:
        return iter(self._store.list_versions(self._run_id))

    def __len__(self) -> int:
        return len(self._store.list_versions(self._run_id))


class Store:
    """Runs and versions under one root URL.

    `url`: a folder path or `file://PATH` (default kind), `memory://NAME` (in-process, for
    tests) or `s3://BUCKET/PREFIX`. `storage_options` go to the adapter (for S3:
    `endpoint_url`, `key`, `secret`, `region_name`; the endpoint may also come from
    `TETHER_S3_ENDPOINT_URL` or `AWS_ENDPOINT_URL`). `cache_dir`: a local folder where
    `open_version` keeps verified copies of fetched files (None: no disk cache).
    `objects`: an adapter already open on `url` to use instead of opening one (many agents
    in one process sharing a client, each through its own wrapper).
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        objects: ObjectStore | None = None,
    ) -> None:
        self.objects: ObjectStore = (
            objects if objects is not None else open_objects(url, storage_options)
        )
        self.url = self.objects.url
        self.cache = FileCache(cache_dir) if cache_dir is not None else None

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # ---- runs -------------------------------------------------------------------------

    def create_run(
        self,
        run_id: str,
        *,
        boot_version: int = 0,
        base_checkpoint: str | None = None,
        canonical_dtype: str = "BF16",
    ) -> RunMetadata:
        """Create `<run_id>/run.json`; return the run (the existing one if identical).

        Raise `AlreadyExists` if the run exists with different metadata.
        """
        info = RunMetadata(
            run_id=run_id,
            boot_version=boot_version,
            base_checkpoint=base_checkpoint,
            canonical_dtype=canonical_dtype,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        if self.objects.put_if_absent(run_key(run_id), info.to_json()):
            log.info("created run %s in %s (boot version %d)", run_id, self.url, boot_version)
            return info
        existing = self.read_run(run_id)
        if not existing.same_request(info):
            raise AlreadyExists(
                f"run {run_id!r} already exists in {self.url} with boot_version="
                f"{existing.boot_version}, base_checkpoint={existing.base_checkpoint!r}, "
                f"canonical_dtype={existing.canonical_dtype!r}; asked for boot_version="
                f"{boot_version}, base_checkpoint={base_checkpoint!r}, canonical_dtype="
                f"{canonical_dtype!r}. Use the same metadata or a new run id"
            )
        return existing

    def read_run(self, run_id: str) -> RunMetadata:
        """The run's metadata. A run written by Stitch (no run.json) gets the defaults.

        Raise `VersionNotFound` if the store holds nothing of the run.
        """
        try:
            return RunMetadata.from_json(self.objects.get(run_key(run_id)))
        except FileNotFoundError:
            pass
        listing = self.objects.list(f"{validate_run_id(run_id)}/")
        if listing.dirs or listing.files:
            return RunMetadata(run_id=run_id)
        known = ", ".join(self.list_runs()[:10]) or "none"
        raise VersionNotFound(
            f"run {run_id!r} does not exist in {self.url} (runs: {known}); "
            "check the run id or create the run first"
        )

    def list_runs(self) -> list[str]:
        """Every run id at the store root, sorted."""
        runs = []
        for name in self.objects.list("").dirs:
            try:
                runs.append(validate_run_id(name))
            except InvalidName:
                log.debug("ignoring %r at the root of %s: not a run id", name, self.url)
        return sorted(runs)

    # ---- pointer ----------------------------------------------------------------------

    def read_pointer(self, run_id: str) -> VersionRef | None:
        """The version `<run_id>/latest` names, or None before the run's first publish."""
        return Pointer(self.objects, run_id).read()[0]

    def move_pointer(self, run_id: str, expected: Expected, new: VersionRef) -> VersionRef | None:
        """Move `latest` from `expected` to `new` by compare-and-swap; return the previous.

        `new` must be complete in the store. `expected` is the version the caller last saw
        (None: unset) or `READ_NOW`. Raise `PointerConflict` on a lost race or a stale
        expectation, `PointerRewind` if `new` is not ahead of the pointer.
        """
        run = self.read_run(run_id)
        info = self._version_info(new)
        if not info.complete:
            raise VersionNotFound(
                f"{new.identity} is not complete in {self.url} (index or shards missing); "
                "write and verify it (write_version) before moving the pointer"
            )
        return Pointer(self.objects, run_id).move(expected, new, boot_version=run.boot_version)

    # ---- versions ---------------------------------------------------------------------

    def list_versions(self, run_id: str) -> list[int]:
        """The run's complete versions (index and every shard present), ascending."""
        return [info.ref.version for info in self.version_infos(run_id) if info.complete]

    def version_infos(self, run_id: str) -> list[StoredVersion]:
        """Every version folder of the run, complete or not, ascending."""
        infos = []
        for name in self.objects.list(updates_prefix(run_id)).dirs:
            try:
                version = parse_version_dir_name(name)
            except InvalidName:
                continue
            info = self._version_info(VersionRef(run_id, version))
            if info.sizes:  # some object stores keep a deleted folder's empty prefix
                infos.append(info)
        return sorted(infos, key=lambda info: info.ref.version)

    def _version_info(self, ref: VersionRef) -> StoredVersion:
        sizes = dict(self.objects.list(version_prefix(ref)).files)
        manifest = None
        complete = False
        if INDEX_FILENAME in sizes:
            try:
                manifest = Manifest.from_index_json(
                    self.objects.get(version_file_key(ref, INDEX_FILENAME))
                )
            except (CorruptPayload, InvalidName) as exc:
                log.warning("%s has an unreadable index: %s", ref, exc)
            except FileNotFoundError:
                sizes.pop(INDEX_FILENAME)
            if manifest is not None:
                complete = manifest.version == ref.version and all(
                    shard in sizes for shard in manifest.shard_files()
                )
        return StoredVersion(ref=ref, manifest=manifest, sizes=sizes, complete=complete)

    def read_manifest(self, ref: VersionRef) -> Manifest:
        """The version's parsed index; `VersionNotFound` if it has none."""
        try:
            data = self.objects.get(version_file_key(ref, INDEX_FILENAME))
        except FileNotFoundError:
            raise VersionNotFound(
                f"{ref.identity} has no {INDEX_FILENAME} in {self.url} (versions: "
                f"{self.list_versions(ref.run_id)}); it was never published or was deleted"
            ) from None
        manifest = Manifest.from_index_json(data)
        if manifest.version != ref.version:
            raise CorruptPayload(
                f"{ref.identity}/{INDEX_FILENAME} says version {manifest.version}; "
                "the folder and its index disagree, republish the version"
            )
        return manifest

    # ---- publish ----------------------------------------------------------------------

    def publish(
        self,
        ref: VersionRef,
        files: Mapping[str, bytes],
        *,
        expected: Expected = READ_NOW,
    ) -> PublishReceipt:
        """Write every file, verify each read back, then move `latest` to `ref` by CAS.

        `files` maps file names to bytes and includes the index (as `encode_version`
        returns them). `expected` is the pointer the caller believes is current; the
        default takes it as read when publish starts. Nothing is written if the input is
        invalid, the run is unknown or the pointer would not move forward.
        """
        manifest = _check_files(ref, files)
        run = self.read_run(ref.run_id)
        pointer = Pointer(self.objects, ref.run_id)
        current = pointer.check(expected, ref, boot_version=run.boot_version)
        expected = current if expected is READ_NOW else expected
        written = self._write_checked(ref, files, manifest, run)
        started = time.perf_counter()
        previous = pointer.move(expected, ref, boot_version=run.boot_version)
        cas_s = time.perf_counter() - started
        return PublishReceipt(
            ref=ref,
            previous=previous,
            bytes_written=written.bytes_written,
            write_s=written.write_s,
            verify_s=written.verify_s,
            cas_s=cas_s,
        )

    def write_version(self, ref: VersionRef, files: Mapping[str, bytes]) -> WriteReceipt:
        """The first half of `publish`: claim, write and verify a version; no pointer move."""
        manifest = _check_files(ref, files)
        return self._write_checked(ref, files, manifest, self.read_run(ref.run_id))

    def _write_checked(
        self, ref: VersionRef, files: Mapping[str, bytes], manifest: Manifest, run: RunMetadata
    ) -> WriteReceipt:
        if ref.version < run.boot_version:
            raise InvalidVersion(
                f"{ref.identity} is below run {ref.run_id!r}'s boot version "
                f"{run.boot_version}; publish version {run.boot_version} or later"
            )
        digests = {name: tensor_checksum(data) for name, data in files.items()}
        claim = json.dumps(
            {name: [len(files[name]), digests[name]] for name in sorted(files)}, sort_keys=True
        ).encode()
        claim_key = version_file_key(ref, CLAIM_FILENAME)
        info = self._version_info(ref)
        if info.complete and not self._claim_is(claim_key, claim):
            raise AlreadyExists(
                f"{ref.identity} already exists in {self.url} with other bytes; versions are "
                f"immutable, publish a higher version number"
            )
        started = time.perf_counter()
        if not self.objects.put_if_absent(claim_key, claim) and not self._claim_is(
            claim_key, claim
        ):
            raise PointerConflict(
                f"another publisher claimed {ref.identity} with different bytes; re-read the "
                "pointer and publish the next version number"
            )
        # The index goes last: until it exists no reader counts the version as present.
        ordered = [name for name in files if name != INDEX_FILENAME] + [INDEX_FILENAME]
        for name in ordered:
            self.objects.put(version_file_key(ref, name), bytes(files[name]))
        write_s = time.perf_counter() - started
        started = time.perf_counter()
        for name in ordered:
            stored = self.objects.get(version_file_key(ref, name))
            if len(stored) != len(files[name]) or tensor_checksum(stored) != digests[name]:
                raise ChecksumMismatch(
                    f"{ref.identity}/{name} read back as {len(stored)} bytes with digest "
                    f"{tensor_checksum(stored)}, expected {len(files[name])} bytes with "
                    f"{digests[name]}; the pointer was not moved, publish again"
                )
        verify_s = time.perf_counter() - started
        total = sum(len(files[name]) for name in ordered)
        log.info(
            "wrote %s (%s, %d files, %d bytes) to %s",
            ref,
            manifest.kind,
            len(files),
            total,
            self.url,
        )
        return WriteReceipt(ref=ref, bytes_written=total, write_s=write_s, verify_s=verify_s)

    def _claim_is(self, claim_key: str, claim: bytes) -> bool:
        try:
            return self.objects.get(claim_key) == claim
        except FileNotFoundError:
            return False

    # ---- read side --------------------------------------------------------------------

    def open_version(
        self,
        ref: VersionRef,
        sources: SourcedFetch | None = None,
        relayed: RelayedVersion | None = None,
    ) -> VersionFiles:
        """The version's files as a lazy `Mapping[str, bytes]` (index and shards).

        Files are fetched on first access and, with a `cache_dir`, kept there verified.
        `VersionFiles.header(name)` reads a shard's safetensors header by ranged reads.
        With `sources`, a shard is asked of them first and used only if it matches the size
        and digest the version's claim records in this store (a version without a claim,
        e.g. one Stitch wrote, is read from this store only). With `relayed` (the version's
        claim and index as read from this store by someone else, checked against each
        other) neither is read again: the shards are checked against its claim.
        """
        if relayed is not None:
            files = VersionFiles(
                self.objects, ref, _relayed_info(relayed).version_files, self.cache, sources,
                relayed.digests if sources is not None and sources.sources else None,
            )  # fmt: skip
            files.hold(INDEX_FILENAME, relayed.index)
            return files
        info = self._version_info(ref)
        if not info.complete:
            raise VersionNotFound(
                f"{ref.identity} is not a complete version in {self.url} (complete versions: "
                f"{self.list_versions(ref.run_id)}); pick one of those"
            )
        digests = self.file_digests(ref) if sources is not None and sources.sources else None
        return VersionFiles(self.objects, ref, info.version_files, self.cache, sources, digests)

    def file_digests(self, ref: VersionRef) -> dict[str, FileDigest]:
        """Each file's size and xxh3-128 digest as the version's claim records them
        (empty when the version has no readable claim)."""
        try:
            claim = json.loads(self.objects.get(version_file_key(ref, CLAIM_FILENAME)))
        except FileNotFoundError:
            return {}
        except ValueError:
            log.warning("%s has an unreadable claim; reading it from %s only", ref, self.url)
            return {}
        digests = {}
        for name, entry in claim.items() if isinstance(claim, dict) else ():
            if isinstance(entry, list) and len(entry) == 2:
                size, digest = entry
                if isinstance(size, int) and isinstance(digest, str):
                    digests[name] = FileDigest(size, digest)
        return digests

    def plan_catch_up(
        self,
        run_id: str,
        target: int,
        have: int | None = None,
        relayed: Mapping[int, RelayedVersion] | None = None,
    ) -> CatchUpPlan:
        """Versions to fetch to reach `target`: from `have` if its chain leads there, else
        from the nearest FULL anchor at or below `target`, then the deltas in order.
        `relayed`: versions whose claim and index someone already read from this store
        (`RelayedVersion`); they are planned from those, the others from the store."""
        validate_version(target, "target")
        available = CompleteVersions(self, run_id, relayed)

        def describe(version: int) -> tuple[VersionKind, int | None]:
            manifest = available.info(version).manifest
            assert manifest is not None  # complete versions have one
            return manifest.kind, manifest.base_version

        return plan_catch_up(run_id, target, available=available, describe=describe, have=have)

    def materialize(
        self,
        run_id: str,
        target: int,
        *,
        base: Mapping[str, RawTensor] | None = None,
        have: int | None = None,
        progress: Progress | None = None,
        sources: SourcedFetch | None = None,
        on_plan: Callable[[CatchUpPlan], None] | None = None,
        relayed: Mapping[int, RelayedVersion] | None = None,
    ) -> dict[str, RawTensor]:
        """The canonical tensors of version `target`, every target checksum verified.

        With `base` (the tensors of version `have`, which the caller holds) the fold starts
        from it when its chain reaches `target`; otherwise from the nearest FULL anchor.
        `base` is never modified. `sources`: other places to fetch files from before this
        store (see `open_version`). `on_plan` hears the plan before any byte is fetched.
        `relayed`: versions planned and verified from a relayed claim and index instead of
        reading those from this store (see `plan_catch_up`).
        """
        from store.codecs import decode_version, fold

        if (base is None) != (have is None):
            raise InvalidVersion(
                "pass base and have together: base is the tensors of version have "
                f"(got base={'given' if base is not None else None}, have={have!r})"
            )
        relayed = relayed or {}
        plan = self.plan_catch_up(run_id, target, have, relayed)
        if on_plan is not None:
            on_plan(plan)
        total = len(plan.downloads) + 1
        fetched = [
            self.open_version(VersionRef(run_id, version), sources, relayed.get(version))
            for version in plan.downloads
        ]
        fetch_versions(
            fetched,
            None
            if progress is None
            else lambda done: progress(
                done + 1, total, f"fetched {run_id} v{plan.downloads[done]}"
            ),
        )
        if plan.from_have:
            assert base is not None
            start: Mapping[str, RawTensor] = base
            deltas = fetched
        else:
            start = decode_version(fetched[0], None)
            deltas = fetched[1:]
        result = fold(start, deltas) if deltas else dict(start)
        if progress:
            progress(total, total, f"folded {run_id} v{target}")
        return result

    def verify(self, ref: VersionRef, progress: Progress | None = None) -> VerifyReport:
        """Check that every file is present and every tensor checksum matches.

        For a delta the target tensors are reconstructed (from the nearest anchor) and
        checked against the checksums its shards record. Problems are reported, not raised.
        """
        report = VerifyReport(ref=ref)
        info = self._version_info(ref)
        if info.manifest is None:
            report.problems.append(f"{ref.identity}: {INDEX_FILENAME} missing or unreadable")
            return report
        shards = info.manifest.shard_files()
        missing = [name for name in shards if name not in info.sizes]
        report.problems += [f"{ref.identity}/{name}: missing" for name in missing]
        if missing:
            return report
        try:
            files = self.open_version(ref)
            recorded: dict[str, str] = {}
            stored: dict[str, RawTensor] = {}
            for done, name in enumerate(shards):
                data = files[name]
                report.files_checked += 1
                report.bytes_checked += len(data)
                tensors, metadata = load_safetensors(data)
                if info.manifest.kind is VersionKind.FULL:
                    stored.update(tensors)
                recorded.update(metadata)  # tensor name -> checksum of its target bytes
                if progress:
                    progress(done + 1, len(shards) + 1, f"read {name}")
            target = (
                stored
                if info.manifest.kind is VersionKind.FULL
                else self.materialize(ref.run_id, ref.version)
            )
            for name, checksum in recorded.items():
                tensor = target.get(name)
                if tensor is None:
                    continue
                report.tensors_checked += 1
                if tensor_checksum(tensor.data) != checksum:
                    report.problems.append(
                        f"{ref.identity}: tensor {name} has checksum "
                        f"{tensor_checksum(tensor.data)}, its shard records {checksum}"
                    )
        except StoreError as exc:
            report.problems.append(f"{ref.identity}: {type(exc).__name__}: {exc}")
        if progress:
            progress(len(shards) + 1, len(shards) + 1, f"checked {ref.identity}")
        return report

    # ---- retention --------------------------------------------------------------------

    def gc(self, run_id: str, keep: int, dry_run: bool = False) -> GcReport:
        """Delete versions outside the newest `keep` and the chains they need.

        Also deletes incomplete version folders below the pointer (left by publishers that
        died). Never deletes the pointer's version or any version its chain needs.
        """
        self.read_run(run_id)
        infos = {info.ref.version: info for info in self.version_infos(run_id)}
        complete = {v: info for v, info in infos.items() if info.complete}
        pointer = self.read_pointer(run_id)
        kept = versions_to_keep(
            complete,
            keep,
            base_of=lambda v: complete[v].base_version,
            pointer=pointer.version if pointer else None,
        )
        doomed = sorted(set(complete) - kept)
        floor = pointer.version if pointer else -1
        stale = sorted(v for v, info in infos.items() if not info.complete and v < floor)
        objects = 0
        freed = 0
        for version in doomed + stale:
            freed += infos[version].bytes
            if dry_run:
                objects += len(infos[version].sizes)
            else:
                objects += self.objects.delete_prefix(version_prefix(infos[version].ref))
        if not dry_run and (doomed or stale):
            log.info("gc of run %s deleted versions %s (%d bytes)", run_id, doomed + stale, freed)
        return GcReport(
            run_id=run_id,
            kept=sorted(kept),
            deleted=doomed,
            incomplete_deleted=stale,
            objects_deleted=objects,
            bytes_freed=freed,
            dry_run=dry_run,
        )


def _check_files(ref: VersionRef, files: Mapping[str, bytes]) -> Manifest:
    """Validate a version's files before anything is written; return its manifest."""
    if not isinstance(ref, VersionRef):
        raise InvalidName(f"expected a VersionRef, got {ref!r}; use VersionRef(run_id, version)")
    for name, data in files.items():
        validate_file_name(name)
        if name == CLAIM_FILENAME:
            raise InvalidName(f"{CLAIM_FILENAME!r} is reserved for the store's own bookkeeping")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidName(f"file {name!r} must be bytes, got {type(data).__name__}")
    if INDEX_FILENAME not in files:
        raise CorruptPayload(
            f"files for {ref.identity} lack {INDEX_FILENAME}; pass everything encode_version "
            f"returned (got {sorted(files)[:5]})"
        )
    manifest = Manifest.from_index_json(bytes(files[INDEX_FILENAME]))
    if manifest.version != ref.version:
        raise InvalidVersion(
            f"index says version {manifest.version} but the files are published as "
            f"{ref.identity}; encode with version={ref.version}"
        )
    if manifest.base_version is not None and manifest.base_version >= ref.version:
        raise InvalidVersion(
            f"{ref.identity} is a delta on version {manifest.base_version}; a delta's base "
            "must be an earlier version"
        )
    missing = [name for name in manifest.shard_files() if name not in files]
    if missing:
        raise CorruptPayload(
            f"the index of {ref.identity} names shards {missing} that are not in the files; "
            "pass every file encode_version returned"
        )
    return manifest
