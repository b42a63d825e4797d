"""A version's manifest: its `model.safetensors.index.json`, parsed and written.

The index is a Hugging Face index (`metadata` + `weight_map`) that also carries Stitch's keys:
`version` and, for a delta, `base_version`, `delta_encoding`, `compression_format`,
`checksum_format` (numbers as six-digit strings, e.g. "000007"). A FULL version's metadata
holds `total_size` (as Hugging Face writes it), `version` and `checksum_format`. This module
only converts between bytes and `Manifest`; it never reads tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from store.errors import CorruptPayload, InvalidName
from store.safetensors_io import validate_tensor_name
from store.types import VersionKind

INDEX_FILENAME = "model.safetensors.index.json"


def _version_number(value: object, key: str) -> int:
    # Stitch writes "000007"; Hugging Face tooling may leave a plain int.
    if isinstance(value, bool):
        raise CorruptPayload(f"index metadata {key!r} must be a version number, got {value!r}")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise CorruptPayload(
        f'index metadata {key!r} must be a version number like "000007", got {value!r}'
    )


def validate_shard_name(name: object) -> str:
    """A shard file name must be one plain relative path segment ending in .safetensors."""
    if (
        not isinstance(name, str)
        or not name.endswith(".safetensors")
        or "/" in name
        or "\\" in name
        or ".." in name
        or "\x00" in name
    ):
        raise InvalidName(
            f"shard file {name!r} is not allowed: expected a plain file name ending in "
            "'.safetensors' (no '/', '\\' or '..')"
        )
    return name


@dataclass
class Manifest:
    """What one version directory holds, read from its index file."""

    version: int
    kind: VersionKind
    base_version: int | None
    delta_encoding: str | None
    compression_format: str | None
    checksum_format: str | None
    weight_map: dict[str, str] = field(default_factory=dict)
    total_size: int = 0

    def shard_files(self) -> list[str]:
        """The shard file names the index names, sorted, each once."""
        return sorted(set(self.weight_map.values()))

    def to_index_json(self) -> bytes:
        """The index file's bytes (key order as Stitch writes it; `json.dumps` defaults)."""
        meta: dict[str, Any] = {}
        if self.kind is VersionKind.FULL:
            meta["total_size"] = self.total_size
        meta["version"] = f"{self.version:06d}"
        if self.base_version is not None:
            meta["base_version"] = f"{self.base_version:06d}"
        if self.delta_encoding is not None:
            meta["delta_encoding"] = self.delta_encoding
        if self.compression_format is not None:
            meta["compression_format"] = self.compression_format
        if self.checksum_format is not None:
            meta["checksum_format"] = self.checksum_format
        return json.dumps({"metadata": meta, "weight_map": self.weight_map}).encode("utf-8")

    @classmethod
    def from_index_json(cls, data: bytes | str) -> Manifest:
        """Parse index bytes; `CorruptPayload` on bad JSON or missing keys."""
        try:
            index = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptPayload(f"{INDEX_FILENAME} is not valid JSON: {exc}") from None
        if not isinstance(index, dict):
            raise CorruptPayload(f"{INDEX_FILENAME} must be a JSON object")
        meta = index.get("metadata")
        weight_map = index.get("weight_map")
        if not isinstance(meta, dict) or "version" not in meta:
            raise CorruptPayload(
                f"{INDEX_FILENAME} needs metadata.version (Stitch's version number); "
                f"found metadata {meta!r}"
            )
        if not isinstance(weight_map, dict):
            raise CorruptPayload(f"{INDEX_FILENAME} needs a weight_map object")
        for name, shard in weight_map.items():
            validate_tensor_name(name)
            validate_shard_name(shard)
        delta_encoding = meta.get("delta_encoding")
        kind = VersionKind.DELTA if delta_encoding else VersionKind.FULL
        base_version = None
        if kind is VersionKind.DELTA:
            if "base_version" not in meta:
                raise CorruptPayload(
                    f"delta index ({delta_encoding!r}) has no metadata.base_version"
                )
            base_version = _version_number(meta["base_version"], "base_version")
        total = meta.get("total_size", 0)
        if isinstance(total, str) and total.isdigit():
            total = int(total)
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise CorruptPayload(f"index metadata total_size must be a size, got {total!r}")
        return cls(
            version=_version_number(meta["version"], "version"),
            kind=kind,
            base_version=base_version,
            delta_encoding=delta_encoding or None,
            compression_format=meta.get("compression_format"),
            checksum_format=meta.get("checksum_format"),
            weight_map={str(k): str(v) for k, v in weight_map.items()},
            total_size=total,
        )
