"""The anchor policy: when a published version should be FULL rather than a delta.

A FULL anchor bounds how far back a catch-up must read, and a delta that is not much smaller
than the checkpoint saves nothing. Pure decision; it never encodes or stores anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from store.errors import InvalidVersion
from store.types import VersionKind, validate_version


@dataclass
class AnchorPolicy:
    """FULL every `every` versions since the last anchor, or when a delta would be more than
    `max_delta_ratio` of the full size, or when there is no anchor yet."""

    every: int = 10
    max_delta_ratio: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise InvalidVersion(f"anchor interval must be an integer >= 1, got {self.every!r}")
        if not 0 < self.max_delta_ratio <= 1:
            raise InvalidVersion(f"max_delta_ratio must be in (0, 1], got {self.max_delta_ratio!r}")

    def choose(
        self, version: int, last_anchor: int | None, delta_bytes: int | None, full_bytes: int
    ) -> VersionKind:
        """FULL or DELTA for `version`.

        `last_anchor` is the newest FULL version before it (None: no base, so FULL);
        `delta_bytes` is the encoded delta's size if already known (None: not measured, the
        size rule is skipped), `full_bytes` the full checkpoint's size.
        """
        validate_version(version)
        if last_anchor is None:
            return VersionKind.FULL
        validate_version(last_anchor, "last_anchor")
        if version - last_anchor >= self.every:
            return VersionKind.FULL
        if delta_bytes is not None and delta_bytes > self.max_delta_ratio * full_bytes:
            return VersionKind.FULL
        return VersionKind.DELTA
