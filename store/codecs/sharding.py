"""How a version's tensors are grouped into shard files: names, grouping, reading back.

FULL versions use Hugging Face's names (`model-00001-of-00003.safetensors`, numbered from 1);
delta versions use Stitch's (`model-00000-of-00001.safetensors`, numbered from 0). Reading
checks that every tensor sits in the shard the index names and that none is missing; what the
tensors mean is the codecs' business.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from store.errors import CorruptPayload
from store.manifest import Manifest
from store.safetensors_io import load
from store.tensors import RawTensor


def plan_shards(sizes: Sequence[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Group tensors, in order, into shards of at most `shard_bytes` (a bigger one stands alone)."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    groups: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in sizes:
        if current and current_bytes + nbytes > shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def full_shard_name(index: int, count: int) -> str:
    """Hugging Face's shard name for the `index`-th (0-based) of `count` shards."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def delta_shard_name(index: int, count: int) -> str:
    """Stitch's delta shard name for the `index`-th (0-based) of `count` shards."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def read_shard(files: Mapping[str, bytes], shard: str) -> bytes:
    """`files[shard]`, or `CorruptPayload` naming the missing file."""
    try:
        return files[shard]
    except KeyError:
        raise CorruptPayload(
            f"the index names shard {shard!r} but the version holds no such file; "
            "the version is incomplete, fetch it again"
        ) from None


def read_shards(
    files: Mapping[str, bytes], manifest: Manifest
) -> Iterator[tuple[str, str, RawTensor, str | None]]:
    """Yield (shard, tensor name, tensor, recorded checksum or None) for every tensor.

    Each shard is read once. Raises `CorruptPayload` if a shard holds a tensor the index puts
    elsewhere, or (after the last shard) if the index names a tensor no shard holds.
    """
    seen: set[str] = set()
    for shard in manifest.shard_files():
        tensors, metadata = load(read_shard(files, shard))
        for name, tensor in tensors.items():
            if manifest.weight_map.get(name) != shard:
                raise CorruptPayload(
                    f"shard {shard!r} holds tensor {name!r} that the index places in "
                    f"{manifest.weight_map.get(name)!r}"
                )
            seen.add(name)
            yield shard, name, tensor, metadata.get(name)
    missing = [name for name in manifest.weight_map if name not in seen]
    if missing:
        raise CorruptPayload(
            f"the index names {len(missing)} tensors its shards lack, e.g. {missing[0]!r}"
        )
