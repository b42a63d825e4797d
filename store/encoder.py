"""Encoding the next version of a run: FULL or DELTA by the anchor policy, a delta's tensors
encoded in parallel, the last published tensors kept as the next delta's base.

Owns the writer's bookkeeping that every publisher of a run needs (the trainer's
`Publisher`, the store-only demo): the last version, its tensors and the newest FULL
anchor. It writes nothing: `Store.publish` writes the files and moves the pointer, and only
then does the caller `accept` the encoded version, so a failed upload leaves the base as it
was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from store.anchor import AnchorPolicy
from store.codecs import DEFAULT_SHARD_BYTES, Progress, encode_version, get_codec
from store.manifest import INDEX_FILENAME, Manifest
from store.store import Store
from store.tensors import RawTensor, total_bytes
from store.types import VersionKind


@dataclass(frozen=True)
class EncodedVersion:
    """The files of one version, ready for `Store.publish`, and what they hold."""

    version: int
    kind: VersionKind
    files: dict[str, bytes]
    base_version: int | None  # the delta's base; None for a FULL version
    changed_tensors: int
    full_bytes: int  # the canonical tensors' size, whatever the kind
    tensors: Mapping[str, RawTensor]  # the version's tensors: the next delta's base

    @property
    def bytes(self) -> int:
        return sum(len(data) for data in self.files.values())


def _no_progress(_done: int, _total: int, _what: str) -> None:
    return None


class VersionEncoder:
    """Encodes the successive versions of one run with one codec and anchor policy.

    `codec` is the delta codec ("sparse", "xor") or "full" to encode every version whole;
    `workers` bounds the encoding threads.
    """

    def __init__(
        self,
        codec: str = "sparse",
        anchor_policy: AnchorPolicy | None = None,
        *,
        workers: int | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> None:
        self.codec = get_codec(codec)
        self.anchor_policy = anchor_policy or AnchorPolicy()
        self.workers = workers or min(8, os.cpu_count() or 1)
        self.shard_bytes = shard_bytes
        self.base: Mapping[str, RawTensor] | None = None
        self.base_version: int | None = None
        self.last_anchor: int | None = None

    def resume(self, store: Store, run_id: str, version: int) -> None:
        """Continue after the store's version `version` of `run_id` (a restarted writer):
        its tensors become the base, its newest FULL anchor at or below it the last anchor."""
        self.base = store.materialize(run_id, version)
        self.base_version = version
        anchors = [
            info.ref.version
            for info in store.version_infos(run_id)
            if info.complete and info.kind is VersionKind.FULL and info.ref.version <= version
        ]
        self.last_anchor = max(anchors) if anchors else None

    def encode(
        self,
        target: Mapping[str, RawTensor],
        version: int,
        progress: Progress = _no_progress,
    ) -> EncodedVersion:
        """Version `version` of `target`: a DELTA against the base when the anchor policy
        allows one and it is small enough, else FULL. Changes nothing until `accept`."""
        full_bytes = total_bytes(target)
        base, base_version = self.base, self.base_version
        if base is not None and base_version is not None and self.codec.delta is not None:
            kind = self.anchor_policy.choose(version, self.last_anchor, None, full_bytes)
            if kind is VersionKind.DELTA:
                files = encode_version(
                    target,
                    base,
                    version=version,
                    base_version=base_version,
                    codec=self.codec.name,
                    shard_bytes=self.shard_bytes,
                    workers=self.workers,
                    progress=progress,
                )
                delta_bytes = sum(len(data) for data in files.values())
                kind = self.anchor_policy.choose(version, self.last_anchor, delta_bytes, full_bytes)
                if kind is VersionKind.DELTA:
                    changed = len(Manifest.from_index_json(files[INDEX_FILENAME]).weight_map)
                    return EncodedVersion(
                        version, kind, files, base_version, changed, full_bytes, target
                    )
        progress(0, 1, f"encode v{version} (full)")
        files = encode_version(
            target, None, version=version, base_version=None, codec="full",
            shard_bytes=self.shard_bytes,
        )  # fmt: skip
        progress(1, 1, f"encode v{version} (full)")
        changed = (
            len(target)
            if base is None
            else sum(not np.array_equal(t.data, base[n].data) for n, t in target.items())
        )
        return EncodedVersion(version, VersionKind.FULL, files, None, changed, full_bytes, target)

    def accept(self, encoded: EncodedVersion) -> None:
        """`encoded` is published: its tensors are the next base, a FULL one the anchor."""
        self.base, self.base_version = encoded.tensors, encoded.version
        if encoded.kind is VersionKind.FULL:
            self.last_anchor = encoded.version
