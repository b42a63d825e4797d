"""A delta version: one uint8 payload per changed tensor, grouped in safetensors shards.

The shape is Stitch's: each shard's metadata maps tensor name -> xxh3-128 checksum of the
TARGET tensor's bytes; unchanged tensors are simply absent; the index's metadata names the
`delta_encoding`, `compression_format: zstd` and `checksum_format: xxh3-128`. What a payload
holds is the codec's business (`DeltaCodec`); this module writes and reads the envelope and
never interprets payload bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from store.checksum import CHECKSUM_FORMAT, Digest, tensor_checksum
from store.codecs.sharding import delta_shard_name, plan_shards, read_shards
from store.codecs.workers import tasks
from store.errors import CorruptPayload, TensorMismatch, UnknownCodec
from store.manifest import INDEX_FILENAME, Manifest
from store.safetensors_io import dump, validate_tensor_name
from store.tensors import RawTensor
from store.types import VersionKind

COMPRESSION_FORMAT = "zstd"

# progress(done, total, what), for callers that draw their own progress.
Progress = Callable[[int, int, str], None]
_Result = TypeVar("_Result")


class DeltaCodec(Protocol):
    """Turns (base, target) tensor pairs into payloads and applies them back."""

    name: str  # what users pick: "xor", "sparse"
    delta_encoding: str  # what the index records: "xor", "sparse-v1"

    def encode_tensor(self, target: RawTensor, base: RawTensor) -> np.ndarray | None:
        """The payload (1-D uint8) turning `base` into `target`, or None if they are equal."""
        ...

    def apply_into(
        self,
        out: np.ndarray,
        payload: np.ndarray,
        itemsize: int,
        name: str,
        source: np.ndarray | None = None,
        digest: Digest | None = None,
    ) -> np.ndarray | None:
        """Patch `out` (the previous state's bytes, writable) into the next state in place,
        and return the sorted flat element positions it may have changed (int64; a
        superset is allowed), or None if the codec cannot tell cheaply.

        With `source` (the previous state's bytes, as many as `out`'s, never written),
        `out` starts uninitialised and is filled from `source` as the codec goes: a fold
        then reads and writes each tensor once, not once to copy it and again to patch it.
        With `digest`, every byte of `out` is fed to it once, in order, as soon as it is
        final (a block's bytes right after the block is applied, while they are in cache);
        a codec that fed it nothing leaves a digest no tensor's checksum matches.

        Raise `CorruptPayload` on a payload that does not fit; `out` is then garbage, so
        callers apply into a private copy, never into a base they were given.
        """
        ...


@dataclass(frozen=True)
class DeltaEntry:
    """One changed tensor of a delta version: its payload and the target's checksum."""

    payload: np.ndarray
    checksum: str


def check_same_layout(target: Mapping[str, RawTensor], base: Mapping[str, RawTensor]) -> None:
    """`TensorMismatch` unless both hold the same names with the same dtypes and shapes."""
    for name, tensor in target.items():
        validate_tensor_name(name)
        other = base.get(name)
        if other is None:
            raise TensorMismatch(
                f"tensor {name!r} is in the target but not in the base; a delta needs the "
                "same tensors on both sides (publish a FULL version instead)"
            )
        if not tensor.same_layout(other):
            raise TensorMismatch(
                f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)} in the target but "
                f"{other.dtype}{list(other.shape)} in the base; publish a FULL version instead"
            )
    extra = [name for name in base if name not in target]
    if extra:
        raise TensorMismatch(
            f"tensor {extra[0]!r} is in the base but not in the target "
            f"({len(extra)} such); publish a FULL version instead"
        )


def encode_delta(
    codec: DeltaCodec,
    target: Mapping[str, RawTensor],
    base: Mapping[str, RawTensor],
    *,
    version: int,
    base_version: int,
    shard_bytes: int,
    workers: int = 1,
    progress: Progress | None = None,
) -> dict[str, bytes]:
    """The files of a delta version turning `base` into `target` (shards + index).

    With `workers` > 1 the tensors are encoded on a thread pool (zstd, numpy and xxhash
    release the GIL, so the encodes overlap); the files are the same bytes either way.
    `progress(done, total, "encode")` is called after each tensor.
    """
    check_same_layout(target, base)

    def encode_one(name: str) -> tuple[np.ndarray | None, str | None]:
        tensor = target[name]
        payload = codec.encode_tensor(tensor, base[name])
        return payload, None if payload is None else tensor_checksum(tensor.data)

    names = list(target)
    sizes = [target[name].nbytes for name in names]
    encoded = _map_names(encode_one, names, sizes, workers, progress)
    payloads: dict[str, RawTensor] = {}
    checksums: dict[str, str] = {}
    for name in target:  # the target's order, whatever order the threads finished in
        payload, checksum = encoded[name]
        if payload is None or checksum is None:
            continue
        payloads[name] = RawTensor("U8", (int(payload.size),), payload)
        checksums[name] = checksum
    groups = plan_shards([(name, p.nbytes) for name, p in payloads.items()], shard_bytes)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for index, names in enumerate(groups):
        shard = delta_shard_name(index, len(groups))
        files[shard] = dump(
            {name: payloads[name] for name in names}, {name: checksums[name] for name in names}
        )
        weight_map.update({name: shard for name in names})
    manifest = Manifest(
        version=version,
        kind=VersionKind.DELTA,
        base_version=base_version,
        delta_encoding=codec.delta_encoding,
        compression_format=COMPRESSION_FORMAT,
        checksum_format=CHECKSUM_FORMAT,
        weight_map=weight_map,
    )
    files[INDEX_FILENAME] = manifest.to_index_json()
    return files


def _map_names(
    work: Callable[[str], _Result],
    names: list[str],
    sizes: list[int],
    workers: int,
    progress: Progress | None,
) -> dict[str, _Result]:
    """`work(name)` for every name, on `workers` threads (the small tensors, of `sizes`
    bytes, in batches: `store.codecs.workers.tasks`), reporting progress as they finish."""
    results: dict[str, _Result] = {}
    if workers <= 1:
        for done, name in enumerate(names, start=1):
            results[name] = work(name)
            if progress is not None:
                progress(done, len(names), "encode")
        return results

    def run(group: list[int]) -> list[tuple[str, _Result]]:
        return [(names[i], work(names[i])) for i in group]

    # Codecs keep their zstd contexts per thread, so one instance serves every worker.
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="encode") as pool:
        futures = [pool.submit(run, group) for group in tasks(sizes, workers)]
        for future in as_completed(futures):
            results.update(future.result())
            if progress is not None:
                progress(len(results), len(names), "encode")
    return results


def read_delta(files: Mapping[str, bytes], manifest: Manifest) -> dict[str, DeltaEntry]:
    """Every payload of a delta version with its target checksum, envelope validated."""
    if manifest.compression_format != COMPRESSION_FORMAT:
        raise UnknownCodec(
            f"delta v{manifest.version} uses compression {manifest.compression_format!r}; "
            f"Tether reads only {COMPRESSION_FORMAT!r}"
        )
    if manifest.checksum_format != CHECKSUM_FORMAT:
        raise UnknownCodec(
            f"delta v{manifest.version} uses checksums {manifest.checksum_format!r}; "
            f"Tether verifies only {CHECKSUM_FORMAT!r}"
        )
    entries: dict[str, DeltaEntry] = {}
    for shard, name, tensor, checksum in read_shards(files, manifest):
        if tensor.dtype != "U8" or len(tensor.shape) != 1:
            raise CorruptPayload(
                f"delta payload {name!r} must be a 1-D U8 tensor, found "
                f"{tensor.dtype}{list(tensor.shape)}"
            )
        if checksum is None:
            raise CorruptPayload(
                f"shard {shard!r} records no target checksum for {name!r}; every delta "
                "payload needs one in the shard metadata"
            )
        entries[name] = DeltaEntry(tensor.data, checksum)
    return entries
