"""Folding: applying a chain of versions to a base in one pass per tensor.

Catch-up reads an anchor (or a local base) and the deltas after it. Rather than
materialising every intermediate version, the fold reads every delta's envelope first, then
for each tensor fills a fresh buffer from the base while applying the first of that tensor's
payloads (`DeltaCodec.apply_into`'s `source`: read once, written once), applies the rest in
chain order, and finally checks the checksum the newest delta recorded for it. Any error
is raised before a result is returned, and the base's buffers are never written: an engine
keeps serving its old weights whatever the payload holds.

Must never write into the caller's tensors, and never return a tensor whose checksum was not
verified (tensors no delta touches are returned as the base's own objects). A patched tensor
carries the positions its payloads changed (`RawTensor.changed`, relative to the base
tensor it was folded from), as the codecs report them while applying. Tensors are
applied in parallel on the codec tensor pool (`store.codecs.workers`). The changed tensors
it returns are views of one allocation; when the last of them is dropped it is kept for the
next fold (one at most), not freed.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from store.checksum import TensorDigest
from store.codecs.delta import DeltaCodec, read_delta
from store.codecs.full import decode_full
from store.codecs.registry import codec_for_encoding
from store.codecs.workers import map_tensors
from store.errors import ChecksumMismatch, CorruptPayload, TensorMismatch
from store.manifest import INDEX_FILENAME, Manifest
from store.tensors import ChangedElements, RawTensor
from store.types import VersionKind


def read_manifest(files: Mapping[str, bytes]) -> Manifest:
    """The manifest of a version given as files; `CorruptPayload` if its index is missing."""
    try:
        index = files[INDEX_FILENAME]
    except KeyError:
        raise CorruptPayload(
            f"the version has no {INDEX_FILENAME}; it is incomplete, fetch it again"
        ) from None
    return Manifest.from_index_json(bytes(index))


def _check_lineage(manifests: Sequence[Manifest]) -> None:
    for previous, current in itertools.pairwise(manifests):
        if current.kind is VersionKind.DELTA and current.base_version != previous.version:
            raise CorruptPayload(
                f"delta v{current.version} applies to v{current.base_version}, but the chain "
                f"gives it v{previous.version}; pass the versions in order without gaps"
            )


_ALIGN = 64  # each tensor's buffer starts on a cache line (and any element's alignment)


class _SpareArena:
    """The memory of the last arena nobody holds any more, kept for the next fold.

    A fresh arena is faulted in page by page, and on a machine whose memory is fragmented
    each huge page can first wait for the kernel to compact memory: 30–60 ms of system
    time on a 64 MB arena, more than the fold itself. An agent folds one version after
    another of the same tensors, so the arena of version n - 1, released when its tensors
    are dropped, is exactly what version n + 1 needs. At most one is kept (the most
    recently released), and only reused for a fold that needs at least half of it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memory: np.ndarray | None = None

    def take(self, size: int) -> np.ndarray:
        """An arena of `size` bytes whose memory returns here once every view of it is gone."""
        with self._lock:
            memory, self._memory = self._memory, None
        if memory is None or not size <= memory.size <= 2 * size:
            memory = np.empty(max(size, 1), dtype=np.uint8)
        # Views of `arena` keep it (not `memory`) as their base, so the finalizer runs when
        # the last folded tensor, or anything viewing it, is dropped.
        arena = np.frombuffer(memory.data[:size], dtype=np.uint8)
        weakref.finalize(arena, self._give_back, memory)
        return arena

    def _give_back(self, memory: np.ndarray) -> None:
        with self._lock:
            self._memory = memory


_spare = _SpareArena()


def _fresh_buffers(tensors: Mapping[str, RawTensor], names: list[str]) -> dict[str, np.ndarray]:
    """An uninitialised buffer per named tensor, all views of one allocation.

    One large allocation is backed by huge pages and faulted in once, where a fresh array
    per tensor (most under numpy's 4 MiB huge-page threshold) costs a page fault per 4 KiB:
    copying the base into it ran at ~2.7 GB/s per core, into the shared one at ~10. The
    allocation is the previous fold's when that one has been dropped (`_SpareArena`).
    """
    offsets, total = {}, 0
    for name in names:
        offsets[name] = total
        total += -(-tensors[name].data.nbytes // _ALIGN) * _ALIGN
    arena = _spare.take(total)
    return {
        name: arena[offsets[name] : offsets[name] + tensors[name].data.nbytes] for name in names
    }


def fold_chain(
    base: Mapping[str, RawTensor] | None, versions: Sequence[Mapping[str, bytes]]
) -> dict[str, RawTensor]:
    """The tensors after applying `versions` (oldest first) to `base`.

    A FULL version in the chain replaces everything before it. Raises `CorruptPayload` /
    `ChecksumMismatch` for bad bytes, `TensorMismatch` for a delta that names tensors the
    base lacks or a delta chain without a base.
    """
    manifests = [read_manifest(files) for files in versions]
    _check_lineage(manifests)
    start = 0
    for i, manifest in enumerate(manifests):
        if manifest.kind is VersionKind.FULL:
            base, start = decode_full(versions[i], manifest), i + 1
    if start == len(versions):
        if base is None:
            raise TensorMismatch("nothing to fold: give a base or at least one FULL version")
        return dict(base)
    if base is None:
        raise TensorMismatch(
            f"delta v{manifests[start].version} needs its base v{manifests[start].base_version}; "
            "pass the base tensors or start the chain at a FULL version"
        )

    steps: dict[str, list[tuple[DeltaCodec, np.ndarray]]] = {}
    final_checksum: dict[str, str] = {}
    for files, manifest in zip(versions[start:], manifests[start:], strict=True):
        codec = codec_for_encoding(manifest.delta_encoding or "")
        for name, entry in read_delta(files, manifest).items():
            if name not in base:
                raise TensorMismatch(
                    f"delta v{manifest.version} changes tensor {name!r}, which the base "
                    "does not hold; the base is from another checkpoint"
                )
            steps.setdefault(name, []).append((codec, entry.payload))
            final_checksum[name] = entry.checksum

    changed = [name for name in base if steps.get(name)]
    buffers = _fresh_buffers(base, changed)

    def apply(name: str) -> RawTensor:
        tensor = base[name]
        buffer = buffers[name]
        # The first payload fills the buffer from the base as it applies (no copy pass of
        # its own); later ones patch it in place.
        # The last payload feeds the checksum each stretch of the result as soon as it is
        # final (`apply_into`'s `digest`), instead of a pass rereading the whole tensor.
        source: np.ndarray | None = tensor.data
        digest = TensorDigest(tensor.nbytes)
        positions: np.ndarray | None = np.empty(0, dtype=np.int64)
        chain = steps[name]
        for i, (codec, payload) in enumerate(chain):
            last = digest if i == len(chain) - 1 else None
            step = codec.apply_into(
                buffer, payload, tensor.itemsize, name, source=source, digest=last
            )
            source = None
            if positions is None or step is None:
                positions = None
            else:
                positions = np.union1d(positions, step) if positions.size else step
        found = digest.hexdigest()
        if found != final_checksum[name]:
            raise ChecksumMismatch(
                f"tensor {name!r} hashes to {found} after the chain, expected "
                f"{final_checksum[name]}; a payload is corrupt or the base is not the one "
                "the chain was encoded against"
            )
        record = None if positions is None else ChangedElements(weakref.ref(tensor), positions)
        return RawTensor(tensor.dtype, tensor.shape, buffer, record)

    # Tensors apply in parallel (numpy, zstd and xxh3 release the GIL), the small ones in
    # batches; the result keeps the base's order, and the first error is raised before
    # anything is returned.
    sizes = [base[name].nbytes for name in changed]
    applied = dict(zip(changed, map_tensors(apply, changed, sizes), strict=True))
    return {name: applied.get(name, tensor) for name, tensor in base.items()}
