"""Catch-up planning: which versions to fetch, in which order, to reach a target version.

A plan starts either from a base the caller already holds (`have`, e.g. the version an
engine serves or its boot checkpoint) or from the nearest FULL anchor at or below the
target, then lists the deltas forward to the target. Planning is pure: it reads version
descriptions through a callback and never fetches bytes or decides retention.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from store.errors import VersionNotFound
from store.types import VersionKind, validate_version

# version -> (kind, base_version); base_version is None for FULL versions.
Describe = Callable[[int], tuple[VersionKind, int | None]]


@dataclass(frozen=True)
class CatchUpPlan:
    """Reach `target` by starting at `start` and applying `deltas` in order.

    `from_have` tells whether `start` is the caller's own base (nothing to download for it)
    or a FULL anchor to download. When the caller already holds the target, `start` is the
    target and there are no deltas.
    """

    run_id: str
    target: int
    start: int
    from_have: bool
    deltas: tuple[int, ...]

    @property
    def downloads(self) -> tuple[int, ...]:
        """The versions whose bytes the plan reads from the store, in order."""
        return self.deltas if self.from_have else (self.start, *self.deltas)

    @property
    def up_to_date(self) -> bool:
        return self.from_have and not self.deltas


def plan_catch_up(
    run_id: str,
    target: int,
    *,
    available: Collection[int],
    describe: Describe,
    have: int | None = None,
) -> CatchUpPlan:
    """Walk back from `target` along base versions until `have` or a FULL anchor.

    `available` holds the run's complete versions. `have` is used only if the chain from it
    reaches the target (a newer `have` is ignored: rolling back starts from an anchor).
    Raise `VersionNotFound` if the target, or any version the chain needs, is missing.
    """
    validate_version(target, "target")
    if have is not None:
        validate_version(have, "have")
    if have == target:
        return CatchUpPlan(run_id, target, start=target, from_have=True, deltas=())
    if target not in available:
        raise VersionNotFound(
            f"run {run_id!r} has no complete version {target} (complete: "
            f"{_summary(available)}); publish it or pick an existing version"
        )
    chain: list[int] = []
    version = target
    while True:
        kind, base = describe(version)
        if kind is VersionKind.FULL:
            return CatchUpPlan(run_id, target, version, from_have=False, deltas=_forward(chain))
        chain.append(version)
        if base is None or base >= version:
            raise VersionNotFound(
                f"run {run_id!r} version {version} is a delta without a valid base version "
                f"({base!r}); the chain to {target} is broken, republish a FULL version"
            )
        if base == have:
            return CatchUpPlan(run_id, target, base, from_have=True, deltas=_forward(chain))
        if base not in available:
            raise VersionNotFound(
                f"chain to version {target} of run {run_id!r} is broken: version {version} is a "
                f"delta on version {base}, which the store does not hold completely (complete: "
                f"{_summary(available)}); catch up from a base you hold (have=...) or "
                "publish a FULL version"
            )
        version = base


def _forward(chain: list[int]) -> tuple[int, ...]:
    return tuple(reversed(chain))


def _summary(versions: Collection[int]) -> str:
    ordered = sorted(versions)
    if not ordered:
        return "none"
    if len(ordered) > 8:
        return f"{ordered[0]}..{ordered[-1]} ({len(ordered)} versions)"
    return ", ".join(map(str, ordered))
