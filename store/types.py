"""The store's vocabulary: runs, version references, kinds, constraints and the pointer rule.

Pure values and small pure functions; imports nothing of Tether but `store.errors`. Every
other package speaks in these terms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from store.errors import InvalidName, InvalidVersion, PointerRewind

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")
VERSION_DIR_PREFIX = "weight_v"
VERSION_DIR_DIGITS = 6


def validate_run_id(run_id: str) -> str:
    """Return `run_id` if it is a safe single path segment, else raise `InvalidName`."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or run_id in {".", ".."}:
        raise InvalidName(
            f"run id {run_id!r} is not allowed: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    if ".." in run_id:
        raise InvalidName(f"run id {run_id!r} must not contain '..'")
    return run_id


def validate_version(version: object, field: str = "version") -> int:
    """Return `version` if it is a non-negative int (bools refused), else raise."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidVersion(f"{field} must be a non-negative integer, got {version!r}")
    if version < 0:
        raise InvalidVersion(f"{field} must be a non-negative integer, got {version}")
    return version


def version_dir_name(version: int) -> str:
    """`7` → `weight_v000007` (Stitch's directory name; wider numbers keep all digits)."""
    return f"{VERSION_DIR_PREFIX}{validate_version(version):0{VERSION_DIR_DIGITS}d}"


def parse_version_dir_name(name: str) -> int:
    """`weight_v000007` → `7`; raise `InvalidName` for anything else."""
    match = _VERSION_DIR.match(name)
    if not match:
        raise InvalidName(f"{name!r} is not a version directory (expected weight_vNNNNNN)")
    return int(match.group(1))


class VersionKind(StrEnum):
    """How a version's bytes are stored: a whole checkpoint, or a delta against its base."""

    FULL = "full"
    DELTA = "delta"


@dataclass(frozen=True, order=True)
class VersionRef:
    """One published policy version of one run. Identity string: `<run_id>/weight_v000007`."""

    run_id: str
    version: int

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        validate_version(self.version)

    @property
    def dir_name(self) -> str:
        return version_dir_name(self.version)

    @property
    def identity(self) -> str:
        return f"{self.run_id}/{self.dir_name}"

    @classmethod
    def parse(cls, identity: str) -> VersionRef:
        """Parse `<run_id>/weight_v000007` (surrounding whitespace ignored)."""
        text = identity.strip()
        run_id, sep, dir_name = text.partition("/")
        if not sep:
            raise InvalidName(
                f"version identity {identity!r} must look like '<run_id>/weight_v000007'"
            )
        return cls(validate_run_id(run_id), parse_version_dir_name(dir_name))

    def __str__(self) -> str:
        return self.identity


@dataclass(frozen=True)
class VersionConstraint:
    """What a rollout request accepts: at least `min_version`, or exactly `exact_version`.

    Both may be given only if they agree (`exact_version >= min_version`); neither means any
    version will do.
    """

    min_version: int | None = None
    exact_version: int | None = None

    def __post_init__(self) -> None:
        if self.min_version is not None:
            validate_version(self.min_version, "min_version")
        if self.exact_version is not None:
            validate_version(self.exact_version, "exact_version")
        if (
            self.min_version is not None
            and self.exact_version is not None
            and self.exact_version < self.min_version
        ):
            raise InvalidVersion(
                f"exact_version {self.exact_version} is below min_version {self.min_version}: "
                "no version satisfies both; drop one of them"
            )

    @property
    def is_any(self) -> bool:
        return self.min_version is None and self.exact_version is None

    def satisfied_by(self, version: int | None) -> bool:
        """True if an engine serving `version` may answer (None: serving nothing yet)."""
        if version is None:
            return False
        if self.exact_version is not None:
            return version == self.exact_version
        if self.min_version is not None:
            return version >= self.min_version
        return True

    def describe(self) -> str:
        if self.exact_version is not None:
            return f"exactly v{self.exact_version}"
        if self.min_version is not None:
            return f"v{self.min_version} or newer"
        return "any version"


def decide_pointer_move(current: VersionRef | None, proposed: VersionRef) -> None:
    """The pointer rule: within a run the pointer only moves forward.

    `current` is what `<run>/latest` names now (None before the run's first version, when
    any version, normally the boot version, may start it). Raise `PointerRewind` if the
    move would not advance, `InvalidName` if the two belong to different runs.
    """
    if current is None:
        return
    if current.run_id != proposed.run_id:
        raise InvalidName(
            f"pointer of run {current.run_id!r} cannot name a version of run "
            f"{proposed.run_id!r}; publish to that run's own pointer"
        )
    if proposed.version <= current.version:
        raise PointerRewind(
            f"{proposed.identity} is not newer than the current pointer {current.identity}; "
            "versions only move forward within a run (publish a higher version number)"
        )
