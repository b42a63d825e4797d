"""A version's planning files as relayed by someone who read them from the store.

A catch-up plans and verifies from two small objects of each version: its `.tether-claim`
(each file's size and xxh3-128 digest, written before any of the version's bytes) and its
index (the manifest: kind, base, shards, tensor checksums). Read by every engine from the
store they cost each version a few hundred bytes of store egress per engine, which grows
with the fleet. The control plane reads them once and relays them with a fetch plan
(docs/peers.md); `RelayedVersion.check` accepts such a copy only if it is consistent: the
claim parses, records the index with the relayed index's size and digest, and names every
shard the index names, and the index names this version. What anchors the claim is the
party that relayed it (the control plane, which the agent authenticates to and which read
it from the store); everything else (index, shards from peers or the store, the folded
tensors' checksums) is checked against it exactly as against the store's own claim.

Owns that check only; never reads the store or the network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from store.checksum import tensor_checksum
from store.errors import CorruptPayload, InvalidName
from store.manifest import INDEX_FILENAME, Manifest
from store.sources.sourced_fetch import FileDigest
from store.types import VersionRef


@dataclass(frozen=True)
class RelayedVersion:
    """A complete version's claim and index, checked against each other."""

    ref: VersionRef
    manifest: Manifest
    index: bytes
    digests: dict[str, FileDigest]

    @property
    def sizes(self) -> dict[str, int]:
        """Every file the claim records (index and shards) with its size."""
        return {name: entry.size for name, entry in self.digests.items()}

    @classmethod
    def check(cls, ref: VersionRef, claim: bytes, index: bytes) -> RelayedVersion:
        """The relayed copy of `ref`, or `CorruptPayload` saying what does not match."""
        try:
            parsed = json.loads(claim)
        except ValueError as exc:
            raise CorruptPayload(
                f"the relayed claim of {ref.identity} is not JSON: {exc}"
            ) from None
        digests: dict[str, FileDigest] = {}
        for name, entry in parsed.items() if isinstance(parsed, dict) else ():
            if (
                isinstance(entry, list)
                and len(entry) == 2
                and isinstance(entry[0], int)
                and isinstance(entry[1], str)
            ):
                digests[name] = FileDigest(entry[0], entry[1])
        recorded = digests.get(INDEX_FILENAME)
        if recorded is None:
            raise CorruptPayload(
                f"the relayed claim of {ref.identity} records no {INDEX_FILENAME}; "
                "read the version's claim and index from the store"
            )
        digest = tensor_checksum(index)
        if recorded.size != len(index) or recorded.digest != digest:
            raise CorruptPayload(
                f"the relayed index of {ref.identity} has {len(index)} bytes with digest "
                f"{digest}; its claim records {recorded.size} bytes with {recorded.digest}"
            )
        try:
            manifest = Manifest.from_index_json(index)
        except (CorruptPayload, InvalidName) as exc:
            raise CorruptPayload(f"the relayed index of {ref.identity}: {exc}") from None
        if manifest.version != ref.version:
            raise CorruptPayload(
                f"the relayed index of {ref.identity} says version {manifest.version}"
            )
        missing = [shard for shard in manifest.shard_files() if shard not in digests]
        if missing:
            raise CorruptPayload(
                f"the relayed claim of {ref.identity} does not record shards {missing} "
                "that its index names"
            )
        return cls(ref=ref, manifest=manifest, index=index, digests=digests)
