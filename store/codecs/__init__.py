"""The checkpoint codecs: `full` (a Hugging Face folder), `xor` (Stitch's delta, byte for
byte) and `sparse` (Tether's delta near the entropy of the change).

Public surface: `CODECS`, `get_codec`, `encode_version`, `decode_version`, `fold`. A version
is a mapping of relative file name -> bytes, its index (`model.safetensors.index.json`)
included; any `Mapping` works for reading, so the store can hand in a lazy one. Nothing here
touches storage, torch or the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from store.codecs.delta import DeltaCodec, encode_delta
from store.codecs.full import encode_full
from store.codecs.sparse import SparseCodec
from store.codecs.xor import XorCodec
from store.errors import TensorMismatch, UnknownCodec
from store.tensors import RawTensor
from store.types import VersionKind, validate_version

CODECS = ("full", "xor", "sparse")
DEFAULT_SHARD_BYTES = 2**30


@dataclass(frozen=True)
class Codec:
    """A codec by name: what kind of version it writes and, for a delta, how."""

    name: str
    kind: VersionKind
    delta: DeltaCodec | None = None

    @property
    def delta_encoding(self) -> str | None:
        return self.delta.delta_encoding if self.delta is not None else None


_DELTAS: dict[str, DeltaCodec] = {"xor": XorCodec(), "sparse": SparseCodec()}


def get_codec(name: str) -> Codec:
    """The codec called `name` ("full", "xor" or "sparse"); `UnknownCodec` otherwise."""
    if name == "full":
        return Codec("full", VersionKind.FULL)
    if name in _DELTAS:
        return Codec(name, VersionKind.DELTA, _DELTAS[name])
    raise UnknownCodec(f"unknown codec {name!r}: choose one of {', '.join(CODECS)}")


def codec_for_encoding(delta_encoding: str) -> DeltaCodec:
    """The delta codec that reads an index's `delta_encoding` ("xor", "sparse-v1")."""
    for codec in _DELTAS.values():
        if codec.delta_encoding == delta_encoding:
            return codec
    known = ", ".join(c.delta_encoding for c in _DELTAS.values())
    raise UnknownCodec(
        f"this version uses delta_encoding {delta_encoding!r}, which Tether cannot read "
        f"(it reads: {known}); upgrade Tether or re-publish with a known codec"
    )


def encode_version(
    target: Mapping[str, RawTensor],
    base: Mapping[str, RawTensor] | None,
    *,
    version: int,
    base_version: int | None,
    codec: str,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, bytes]:
    """The files of version `version` of `target`: shards plus the index file.

    `full` ignores `base`. Delta codecs need `base` (the tensors of `base_version`) with the
    same names, dtypes and shapes as `target` (else `TensorMismatch`); unchanged tensors are
    omitted from the delta.
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
    )


def decode_version(
    files: Mapping[str, bytes], base: Mapping[str, RawTensor] | None
) -> dict[str, RawTensor]:
    """The tensors of one version: a FULL one as stored, a delta applied to `base`.

    Target checksums are verified; `base` is never modified (unchanged tensors are returned
    as the base's own objects).
    """
    from store.fold import fold_chain  # store.fold imports this package: import it late

    return fold_chain(base, [files])


def fold(
    base: Mapping[str, RawTensor], deltas: Sequence[Mapping[str, bytes]]
) -> dict[str, RawTensor]:
    """Apply a chain of versions to `base` in one pass per tensor; see `store.fold`."""
    from store.fold import fold_chain

    return fold_chain(base, deltas)
