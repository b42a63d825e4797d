"""The checkpoint codecs: `full` (a Hugging Face folder), `xor` (Stitch's delta, byte for
byte) and `sparse` (Tether's delta near the entropy of the change).

Public surface: `CODECS`, `get_codec`, `encode_version`, `decode_version`, `fold`
(`registry` names the codecs, `fold` applies chains). A version is a mapping of relative
file name -> bytes, its index (`model.safetensors.index.json`) included; any `Mapping` works
for reading, so the store can hand in a lazy one. Nothing here touches storage, torch or
the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from store.codecs.delta import Progress, encode_delta
from store.codecs.fold import fold_chain
from store.codecs.full import encode_full
from store.codecs.registry import CODECS, Codec, codec_for_encoding, get_codec
from store.errors import TensorMismatch
from store.tensors import RawTensor
from store.types import validate_version

__all__ = [
    "CODECS",
    "DEFAULT_SHARD_BYTES",
    "Codec",
    "Progress",
    "codec_for_encoding",
    "decode_version",
    "encode_version",
    "fold",
    "get_codec",
]

DEFAULT_SHARD_BYTES = 2**30


def encode_version(
    target: Mapping[str, RawTensor],
    base: Mapping[str, RawTensor] | None,
    *,
    version: int,
    base_version: int | None,
    codec: str,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 1,
    progress: Progress | None = None,
) -> dict[str, bytes]:
    """The files of version `version` of `target`: shards plus the index file.

    `full` ignores `base`. Delta codecs need `base` (the tensors of `base_version`) with the
    same names, dtypes and shapes as `target` (else `TensorMismatch`); unchanged tensors are
    omitted from the delta, and `workers` threads encode its tensors.
    """
    chosen = get_codec(codec)
    validate_version(version)
    if chosen.delta is None:
        return encode_full(target, version=version, shard_bytes=shard_bytes)
    if base is None or base_version is None:
        raise TensorMismatch(
            f"codec {codec!r} encodes a delta and needs a base and its base_version; "
            "pass them, or use codec 'full'"
        )
    validate_version(base_version, "base_version")
    if base_version >= version:
        raise TensorMismatch(
            f"a delta must go forward: base_version {base_version} is not below {version}"
        )
    return encode_delta(
        chosen.delta,
        target,
        base,
        version=version,
        base_version=base_version,
        shard_bytes=shard_bytes,
        workers=workers,
        progress=progress,
    )


def decode_version(
    files: Mapping[str, bytes], base: Mapping[str, RawTensor] | None
) -> dict[str, RawTensor]:
    """The tensors of one version: a FULL one as stored, a delta applied to `base`.

    Target checksums are verified; `base` is never modified (unchanged tensors are returned
    as the base's own objects).
    """
    return fold_chain(base, [files])


def fold(
    base: Mapping[str, RawTensor], deltas: Sequence[Mapping[str, bytes]]
) -> dict[str, RawTensor]:
    """Apply a chain of versions to `base` in one pass per tensor; see `store.codecs.fold`."""
    return fold_chain(base, deltas)
