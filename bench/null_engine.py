"""`NullEngine`: an engine for the fleet benchmark that serves nothing and records commits.

It answers the engine port the way an SGLang engine would for everything the agent's
control path needs (check, info, pause, load, resume, relabel) without loading a byte, so
the benchmark runs the whole real agent (reconciler, fetch, fold, verify, staging, commit)
against it at a scale no real engine would fit on this machine. `load_from_disk` records
the version, the wall time it was committed and a digest of the staged weights it was
given (so the benchmark can check that every engine got the same bytes for a version,
whichever peers they came through). Never serves a rollout request (the data
path is not what the fleet benchmark measures) and is never used outside `bench/`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import xxhash

from engine_agent.engines.base import Engine, ModelInfo, PauseMode, UpdateResult
from engine_agent.engines.sglang import SGLangDialect


class NullEngine(Engine):
    """One engine stand-in; `commits` holds (version, wall time) in commit order and
    `digests` the staged weights' digest of each committed version."""

    kind: ClassVar[str] = "sglang"

    def __init__(self, name: str, boot_version: int, on_commit: Callable[[int], None]) -> None:
        self.url = f"null://{name}"
        self.dialect = SGLangDialect()
        self.label = str(boot_version)
        self.commits: list[tuple[int, float]] = []
        self.digests: dict[int, str] = {}
        self._on_commit = on_commit

    async def check(self) -> None:
        return None

    async def info(self) -> ModelInfo:
        return ModelInfo(model_path=self.url, weight_version=self.label)

    async def pause(self, mode: PauseMode) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def load_from_disk(self, model_path: str, version: int, mode: PauseMode) -> UpdateResult:
        self.label = str(version)
        self.commits.append((version, time.time()))
        self.digests[version] = staged_digest(Path(model_path))
        self._on_commit(version)
        return UpdateResult(message=f"null engine recorded v{version}", seconds=0.0)

    async def relabel(self, version: int) -> None:
        self.label = str(version)

    async def abort(self, rid: str) -> None:
        return None

    async def close(self) -> None:
        return None


def staged_digest(folder: Path) -> str:
    """xxh3-128 over the folder's safetensors files, in name order."""
    digest = xxhash.xxh3_128()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
