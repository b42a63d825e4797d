"""The codecs by name: which codec writes a version kind, and which reads a `delta_encoding`.

Owns the mapping "full" / "xor" / "sparse" → codec, and `delta_encoding` → the delta codec
that reads it. It encodes nothing itself and must never import `store.codecs` (the package
re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from store.codecs.delta import DeltaCodec
from store.codecs.sparse import SparseCodec
from store.codecs.sparse_v2 import SparseV2Codec
from store.codecs.sparse_v3 import SparseV3Codec
from store.codecs.xor import XorCodec
from store.errors import UnknownCodec
from store.types import VersionKind

CODECS = ("full", "xor", "sparse")


@dataclass(frozen=True)
class Codec:
    """A codec by name: what kind of version it writes and, for a delta, how."""

    name: str
    kind: VersionKind
    delta: DeltaCodec | None = None

    @property
    def delta_encoding(self) -> str | None:
        return self.delta.delta_encoding if self.delta is not None else None


_DELTAS: dict[str, DeltaCodec] = {"xor": XorCodec(), "sparse": SparseV3Codec()}
# Every encoding Tether reads: what the codecs write now plus their older versions
# (`sparse-v1` and `sparse-v2` versions published before `sparse-v3` existed still decode).
_READERS: tuple[DeltaCodec, ...] = (*_DELTAS.values(), SparseV2Codec(), SparseCodec())


def get_codec(name: str) -> Codec:
    """The codec called `name` ("full", "xor" or "sparse"); `UnknownCodec` otherwise."""
    if name == "full":
        return Codec("full", VersionKind.FULL)
    if name in _DELTAS:
        return Codec(name, VersionKind.DELTA, _DELTAS[name])
    raise UnknownCodec(f"unknown codec {name!r}: choose one of {', '.join(CODECS)}")


def codec_for_encoding(delta_encoding: str) -> DeltaCodec:
    """The delta codec that reads an index's `delta_encoding` ("xor", "sparse-v3", ...)."""
    for codec in _READERS:
        if codec.delta_encoding == delta_encoding:
            return codec
    known = ", ".join(c.delta_encoding for c in _READERS)
    raise UnknownCodec(
        f"this version uses delta_encoding {delta_encoding!r}, which Tether cannot read "
        f"(it reads: {known}); upgrade Tether or re-publish with a known codec"
    )
