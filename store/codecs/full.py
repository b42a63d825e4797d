"""The `full` codec: a version that is a whole Hugging Face checkpoint folder.

Shards hold the canonical tensors as they are (SGLang and transformers load the folder as it
is); each shard's metadata carries `format: pt` and, per tensor, the xxh3-128 checksum of its
bytes. The index's metadata holds `total_size`, `version` and `checksum_format`. A FULL
version never depends on a base.
"""

from __future__ import annotations

from collections.abc import Mapping

from store.checksum import CHECKSUM_FORMAT, tensor_checksum
from store.codecs.sharding import full_shard_name, plan_shards, read_shards
from store.errors import ChecksumMismatch
from store.manifest import INDEX_FILENAME, Manifest
from store.safetensors_io import dump as dump_safetensors
from store.safetensors_io import validate_tensor_name
from store.tensors import RawTensor, total_bytes
from store.types import VersionKind

NAME = "full"
# Hugging Face loaders refuse safetensors files whose metadata lacks a known `format`.
_FORMAT_KEY = "format"


def encode_full(
    target: Mapping[str, RawTensor], *, version: int, shard_bytes: int
) -> dict[str, bytes]:
    """The files of a FULL version of `target` (shards + index)."""
    for name in target:
        validate_tensor_name(name)
    groups = plan_shards([(name, t.nbytes) for name, t in target.items()], shard_bytes)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for index, names in enumerate(groups):
        shard = full_shard_name(index, len(groups))
        metadata = {name: tensor_checksum(target[name].data) for name in names}
        metadata[_FORMAT_KEY] = "pt"  # a tensor literally named "format" goes unchecked
        files[shard] = dump_safetensors({name: target[name] for name in names}, metadata)
        weight_map.update({name: shard for name in names})
    manifest = Manifest(
        version=version,
        kind=VersionKind.FULL,
        base_version=None,
        delta_encoding=None,
        compression_format=None,
        checksum_format=CHECKSUM_FORMAT,
        weight_map=weight_map,
        total_size=total_bytes(target),
    )
    files[INDEX_FILENAME] = manifest.to_index_json()
    return files


def decode_full(files: Mapping[str, bytes], manifest: Manifest) -> dict[str, RawTensor]:
    """The tensors of a FULL version, checksums verified where the shards record them.

    Tensors are zero-copy views of the shard bytes, in the index's order.
    """
    found: dict[str, RawTensor] = {}
    for shard, name, tensor, recorded in read_shards(files, manifest):
        if recorded is not None and name != _FORMAT_KEY:
            found_sum = tensor_checksum(tensor.data)
            if found_sum != recorded:
                raise ChecksumMismatch(
                    f"tensor {name!r} in {shard!r} hashes to {found_sum}, expected "
                    f"{recorded}; the shard is corrupt, fetch it again"
                )
        found[name] = tensor
    return {name: found[name] for name in manifest.weight_map}
