"""A run's metadata, `<run_id>/run.json`: base checkpoint, boot version, canonical dtype.

A plain value with its JSON form. Written once, create-only, by `Store.create_run`; it must
never change after that (a different request is an error, not an update).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from store.errors import CorruptPayload
from store.types import validate_run_id, validate_version


@dataclass(frozen=True)
class RunMetadata:
    """What a run starts from: version numbers begin at `boot_version` and go up."""

    run_id: str
    boot_version: int = 0
    base_checkpoint: str | None = None
    canonical_dtype: str = "BF16"
    created: str = ""

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        validate_version(self.boot_version, "boot_version")

    def same_request(self, other: RunMetadata) -> bool:
        """True if both describe the same run (the creation time aside)."""
        return (self.run_id, self.boot_version, self.base_checkpoint, self.canonical_dtype) == (
            other.run_id,
            other.boot_version,
            other.base_checkpoint,
            other.canonical_dtype,
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> RunMetadata:
        try:
            raw = json.loads(data)
            return cls(
                run_id=raw["run_id"],
                boot_version=raw.get("boot_version", 0),
                base_checkpoint=raw.get("base_checkpoint"),
                canonical_dtype=raw.get("canonical_dtype", "BF16"),
                created=raw.get("created", ""),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptPayload(
                f"run.json is not valid run metadata ({exc}); expected JSON with run_id, "
                "boot_version, base_checkpoint, canonical_dtype, created"
            ) from exc
