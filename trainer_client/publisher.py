"""The Publisher: turns a trainer's weights into the next policy version of a run.

Owns the trainer's half of the publish protocol, forward only: cast the master weights to
the run's canonical dtype and check them against the previous version (same names, shapes,
dtypes) → the store encodes the next version (`store.encoder.VersionEncoder`: FULL or DELTA
by the anchor policy, tensors encoded in parallel) → `Store.publish` writes and verifies
every byte, then moves the pointer by compare-and-swap (retried on `StorageUnavailable`)
→ tell the control plane. It never touches codec internals or a storage client.

Invariants, and why they hold:

- Nothing is written for bad input. Names, shapes, dtypes and the version number are
  checked before a byte is encoded; `Store.publish` checks the pointer again before writing.
- The pointer moves last and only forward: `Store.publish` writes and verifies every byte
  first, and expects the pointer to be at this publisher's previous version.
- A failed notification never loses a version: the version is durable once the pointer
  moved; the notification is queued and sent again on the next publish and, with retries
  for a bounded time, on `close()` (`VersionNotifier`). The control plane also adopts a
  pointer that moved without a notification.
- The next delta's base is exactly the canonical tensors of the last published version,
  kept in memory by the encoder (a private copy, so the trainer updating its parameters
  cannot change it), and accepted only once the pointer moved.

This module never decides engine targets and never reads from the control plane beyond
creating the run there.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from store.anchor import AnchorPolicy
from store.codecs import DEFAULT_SHARD_BYTES, Progress
from store.encoder import VersionEncoder
from store.errors import (
    ChecksumMismatch,
    InvalidVersion,
    PointerConflict,
    PointerRewind,
    StorageUnavailable,
    StoreError,
    TensorMismatch,
    VersionNotFound,
)
from store.run_metadata import RunMetadata
from store.store import Store
from store.tensors import RawTensor
from store.types import VersionKind, VersionRef, validate_run_id, validate_version
from trainer_client.notifier import ControlPlaneRefused, VersionNotifier, auth_headers, error_text

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Weights = Mapping[str, "torch.Tensor"] | str | os.PathLike[str]

# Float dtypes a run may keep its canonical tensors in (safetensors code -> torch attribute).
_CANONICAL_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class PublishReport:
    """What one publish produced and how long each phase took (seconds)."""

    version: int
    kind: VersionKind
    bytes: int
    full_bytes: int
    ratio_to_full: float
    encode_s: float
    upload_s: float
    total_s: float
    base_version: int | None = None
    changed_tensors: int = 0
    notified: bool = False


class UploadFailed(StoreError):
    """Every upload attempt of a version failed on a transient store error (network, I/O).

    The pointer was not seen to move (only a lost answer to the very last compare-and-swap
    could hide a move), so the trainer may publish the same weights again once the store
    is reachable."""


def _is_transient(exc: BaseException) -> bool:
    """Store failures worth retrying: the storage was unavailable (network, I/O, a 5xx) or a
    read-back did not match. Refusals (bad names, rewinds, conflicts, immutability) are not."""
    return isinstance(exc, StorageUnavailable | ChecksumMismatch)


def load_hf_folder(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint folder (or one .safetensors file)."""
    from safetensors.torch import load_file

    folder = Path(path)
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise VersionNotFound(
            f"{folder} holds no .safetensors files; pass a Hugging Face checkpoint folder "
            "or a state dict"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def canonical_tensors(weights: Mapping[str, torch.Tensor], dtype: str) -> dict[str, RawTensor]:
    """The weights as the run stores them: floating tensors cast to `dtype`, the rest kept.

    Always a private copy, so later in-place updates of the trainer's parameters cannot
    change what was published.
    """
    import torch

    from store.torch_bridge import to_raw

    if dtype not in _CANONICAL_FLOATS:
        raise TensorMismatch(
            f"canonical dtype {dtype!r} is not supported: expected one of "
            f"{sorted(_CANONICAL_FLOATS)}"
        )
    target = getattr(torch, _CANONICAL_FLOATS[dtype])
    out: dict[str, RawTensor] = {}
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise TensorMismatch(
                f"weight {name!r} is a {type(tensor).__name__}, expected a torch.Tensor"
            )
        value = tensor.detach()
        if value.is_floating_point() and value.dtype != target:
            value = value.to(target)
        out[name] = to_raw(value, copy=True)
    return out


def check_against_base(target: Mapping[str, RawTensor], base: Mapping[str, RawTensor]) -> None:
    """`TensorMismatch` naming every missing, extra or reshaped tensor; None if they agree."""
    missing = sorted(set(base) - set(target))
    extra = sorted(set(target) - set(base))
    changed = [
        f"{name}: {base[name].dtype}{list(base[name].shape)} -> "
        f"{target[name].dtype}{list(target[name].shape)}"
        for name in target
        if name in base and not target[name].same_layout(base[name])
    ]
    if not (missing or extra or changed):
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if extra:
        parts.append(f"unexpected {len(extra)} tensor(s): {', '.join(extra[:5])}")
    if changed:
        parts.append(f"{len(changed)} tensor(s) changed shape or dtype: {'; '.join(changed[:5])}")
    raise TensorMismatch(
        "the weights do not match the run's checkpoint layout (" + "; ".join(parts) + "). "
        "Publish the same tensors with the same shapes as the run's base checkpoint; nothing "
        "was published"
    )


class Publisher:
    """Publishes numbered policy versions of one run to a store and announces them.

    `store_url`: any URL `Store` opens (folder, file://, s3://, memory://). `control_plane`:
    the control plane's base URL (None: store only); `token`: a trainer token for it.
    `anchor_policy` decides FULL vs DELTA; `codec` is the delta codec ("sparse", "xor") or
    "full" to publish every version whole. `workers` bounds the encoding threads.
    """

    def __init__(
        self,
        store_url: str,
        run_id: str,
        control_plane: str | None = None,
        token: str | None = None,
        *,
        anchor_policy: AnchorPolicy | None = None,
        codec: str = "sparse",
        storage_options: dict[str, Any] | None = None,
        workers: int | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        upload_attempts: int = 4,
        progress: bool | None = None,
    ) -> None:
        self.run_id = validate_run_id(run_id)
        self.encoder = VersionEncoder(
            codec, anchor_policy, workers=workers, shard_bytes=shard_bytes
        )
        self.store = Store(store_url, storage_options=storage_options)
        self.upload_attempts = max(1, upload_attempts)
        self.show_progress = sys.stderr.isatty() if progress is None else progress
        self._client: httpx.Client | None = None
        self._closed = False
        self.notifier: VersionNotifier | None = None
        if control_plane:
            self._client = httpx.Client(
                base_url=control_plane.rstrip("/"), headers=auth_headers(token), timeout=30.0
            )
            self.notifier = VersionNotifier(self._client, self.run_id)
        self._run: RunMetadata | None = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self, deliver_within_s: float = 5.0) -> None:
        """Deliver queued notifications, retrying with backoff for at most
        `deliver_within_s` seconds, then release the HTTP client.

        What is still undelivered then is not lost: the versions are in the store, and the
        control plane adopts a pointer that moved past its latest version on its own (at
        start and every few seconds). Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.notifier is not None and self.notifier.pending:
            self.notifier.deliver(deliver_within_s)
        if self._client is not None:
            self._client.close()

    @property
    def version(self) -> int | None:
        """The last version this publisher published or adopted (None before claim)."""
        return self.encoder.base_version

    # ------------------------------------------------------------------ claim

    def claim(
        self,
        boot_version: int = 0,
        base_checkpoint: Weights | None = None,
        *,
        canonical_dtype: str = "BF16",
    ) -> PublishReport | None:
        """Create the run (store and control plane) and make sure its pointer is set.

        `base_checkpoint` is the weights the run starts from: a Hugging Face folder (its
        path is recorded in run.json) or a state dict. If the run has no pointer yet, those
        weights are published as the FULL boot version and the report is returned. If it
        has one (a restarted trainer), the pointer's version becomes the next delta's base
        and None is returned.
        """
        validate_version(boot_version, "boot_version")
        recorded = None
        if base_checkpoint is not None and not isinstance(base_checkpoint, Mapping):
            recorded = str(Path(base_checkpoint).resolve())
        self._run = self.store.create_run(
            self.run_id,
            boot_version=boot_version,
            base_checkpoint=recorded,
            canonical_dtype=canonical_dtype,
        )
        self._create_at_control_plane(self._run)
        pointer = self.store.read_pointer(self.run_id)
        if pointer is not None:
            self._adopt(pointer.version)
            if self.notifier is not None:
                self.notifier.notify(pointer.version, self._kind_of(pointer.version))
            return None
        if base_checkpoint is None:
            raise VersionNotFound(
                f"run {self.run_id!r} has no version yet: pass base_checkpoint (a Hugging "
                "Face folder or state dict) so the boot version can be published"
            )
        return self._publish(self._as_weights(base_checkpoint), boot_version, first=True)

    def _create_at_control_plane(self, run: RunMetadata) -> None:
        if self._client is None:
            return
        body = {
            "run_id": run.run_id,
            "store_url": self.store.url,
            "base_checkpoint": run.base_checkpoint,
            "canonical_dtype": run.canonical_dtype,
            "boot_version": run.boot_version,
        }
        response = self._client.post("/v1/runs", json=body)
        if response.status_code == 201:
            return
        if response.status_code == 409:
            existing = self._client.get(f"/v1/runs/{run.run_id}")
            if existing.status_code == 200 and existing.json().get("store_url") == self.store.url:
                return
            raise ControlPlaneRefused(
                f"run {run.run_id!r} exists at the control plane with another store "
                f"({existing.json().get('store_url') if existing.status_code == 200 else '?'}),"
                f" not {self.store.url}; use a new run id or the same store"
            )
        raise ControlPlaneRefused(
            f"the control plane refused to create run {run.run_id!r}: "
            f"{response.status_code} {error_text(response)}"
        )

    def _adopt(self, version: int) -> None:
        """Take the store's version `version` as the next delta's base (a restart)."""
        self.encoder.resume(self.store, self.run_id, version)
        log.info("publisher of run %s resumes from v%d", self.run_id, version)

    def _kind_of(self, version: int) -> VersionKind:
        return self.store.read_manifest(VersionRef(self.run_id, version)).kind

    # ------------------------------------------------------------------ publish

    def publish(self, weights: Weights, version: int | None = None) -> PublishReport:
        """Publish `weights` (a state dict or a Hugging Face folder) as the next version.

        `version` defaults to the previous version + 1 and must be newer than it. Raises
        `TensorMismatch` (missing, extra or reshaped tensors) or `PointerRewind` (version not
        newer) before anything is written.
        """
        if self.encoder.base is None:
            pointer = self.store.read_pointer(self.run_id)
            if pointer is None:
                raise VersionNotFound(
                    f"run {self.run_id!r} has no published version in {self.store.url}; "
                    "call claim(boot_version, base_checkpoint) first"
                )
            self._adopt(pointer.version)
        assert self.encoder.base_version is not None
        chosen = self.encoder.base_version + 1 if version is None else validate_version(version)
        return self._publish(self._as_weights(weights), chosen, first=False)

    def _as_weights(self, weights: Weights) -> Mapping[str, torch.Tensor]:
        if isinstance(weights, Mapping):
            return weights
        return load_hf_folder(weights)

    def _publish(
        self, weights: Mapping[str, torch.Tensor], version: int, *, first: bool
    ) -> PublishReport:
        started = time.perf_counter()
        if self.notifier is not None and self.notifier.pending:
            self.notifier.flush()
        run = self._run or self.store.read_run(self.run_id)
        self._run = run
        ref = VersionRef(self.run_id, version)
        expected = None if first else VersionRef(self.run_id, self.encoder.base_version or 0)
        self._check_version(ref, expected)
        target = canonical_tensors(weights, run.canonical_dtype)
        if self.encoder.base is not None and not first:
            check_against_base(target, self.encoder.base)

        with self._progress() as progress:
            encoded = self.encoder.encode(target, version, progress)
            encode_s = time.perf_counter() - started
            progress(0, 1, f"upload v{version}")
            upload_started = time.perf_counter()
            written = self._upload(ref, encoded.files, expected)
            upload_s = time.perf_counter() - upload_started
            progress(1, 1, f"upload v{version}")

        self.encoder.accept(encoded)
        kind, full_bytes = encoded.kind, encoded.full_bytes
        notified = self.notifier.notify(version, kind) if self.notifier is not None else False
        report = PublishReport(
            version=version,
            kind=kind,
            bytes=written,
            full_bytes=full_bytes,
            ratio_to_full=written / full_bytes if full_bytes else 0.0,
            encode_s=encode_s,
            upload_s=upload_s,
            total_s=time.perf_counter() - started,
            base_version=encoded.base_version,
            changed_tensors=encoded.changed_tensors,
            notified=notified,
        )
        log.info(
            "published %s (%s, %d bytes, %.3f of full) in %.2fs",
            ref,
            kind.value,
            written,
            report.ratio_to_full,
            report.total_s,
        )
        return report

    def _check_version(self, ref: VersionRef, expected: VersionRef | None) -> None:
        """Refuse, before any work, a version that is not newer or a pointer that moved."""
        pointer = self.store.read_pointer(self.run_id)
        if pointer != expected:
            if pointer is not None and ref.version <= pointer.version:
                raise PointerRewind(
                    f"v{ref.version} is not newer than run {self.run_id!r}'s pointer "
                    f"v{pointer.version}; publish v{pointer.version + 1} or later (nothing "
                    "was published)"
                )
            raise PointerConflict(
                f"run {self.run_id!r}'s pointer names "
                f"{pointer.identity if pointer else 'nothing'}, but this publisher last "
                f"published {expected.identity if expected else 'nothing'}: another "
                "publisher moved it. Start a new Publisher to resume from the pointer"
            )
        if expected is not None and ref.version <= expected.version:
            raise PointerRewind(
                f"v{ref.version} is not newer than the last published v{expected.version} "
                f"of run {self.run_id!r}; versions only go forward, publish "
                f"v{expected.version + 1} or later (nothing was published)"
            )
        if self._run is not None and ref.version < self._run.boot_version:
            raise InvalidVersion(
                f"v{ref.version} is below run {self.run_id!r}'s boot version "
                f"{self._run.boot_version}"
            )

    def _upload(
        self, ref: VersionRef, files: Mapping[str, bytes], expected: VersionRef | None
    ) -> int:
        """`Store.publish`, retried with exponential backoff and full jitter on transient
        errors (`StorageUnavailable`, a bad read-back); the bytes written."""
        attempts = 0

        def publish_once() -> int:
            nonlocal attempts
            attempts += 1
            try:
                return self.store.publish(ref, files, expected=expected).bytes_written
            except PointerConflict:
                # A retry after a lost answer may find its own earlier attempt at the pointer.
                if attempts > 1 and self.store.read_pointer(self.run_id) == ref:
                    return sum(len(data) for data in files.values())
                raise

        def log_retry(state: RetryCallState) -> None:
            failure = state.outcome.exception() if state.outcome is not None else None
            log.warning(
                "upload of %s failed (%s: %s); retry %d/%d in %.2fs",
                ref,
                type(failure).__name__,
                failure,
                state.attempt_number,
                self.upload_attempts - 1,
                state.next_action.sleep if state.next_action is not None else 0.0,
            )

        retrying = Retrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_attempt(self.upload_attempts),
            wait=wait_random_exponential(multiplier=0.25, max=8.0),
            before_sleep=log_retry,
        )
        try:
            return retrying(publish_once)
        except RetryError as exhausted:
            last = exhausted.last_attempt.exception()
            raise UploadFailed(
                f"upload of {ref} failed after {attempts} attempts "
                f"(last: {type(last).__name__}: {last}); the pointer was not seen "
                f"to move. Check that the store at {self.store.url} is reachable, "
                "then publish again"
            ) from last

    @contextmanager
    def _progress(self) -> Iterator[Progress]:
        """A Rich progress bar on stderr when it is a terminal, else a no-op callback."""
        if not self.show_progress:
            yield lambda _done, _total, _what: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as ProgressBar

        bar = ProgressBar(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        tasks: dict[str, Any] = {}

        def update(done: int, total: int, what: str) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)

        with bar:
            yield update
