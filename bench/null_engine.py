"""`NullEngine`: an engine for the fleet benchmark that serves nothing and records commits.

It answers the engine port the way an SGLang engine would for everything the agent's
control path needs (check, info, pause, load, resume, relabel) without loading a byte, so
the benchmark runs the whole real agent (reconciler, fetch, fold, verify, staging, commit)
against it at a scale no real engine would fit on this machine. `load_from_disk` records
the version and the wall time it was committed. Never serves a rollout request (the data
path is not what the fleet benchmark measures) and is never used outside `bench/`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from engine_agent.engines.base import Engine, ModelInfo, PauseMode, UpdateResult
from engine_agent.engines.sglang import SGLangDialect


class NullEngine(Engine):
    """One engine stand-in; `commits` holds (version, wall time) in commit order."""

    kind: ClassVar[str] = "sglang"

    def __init__(self, name: str, boot_version: int, on_commit: Callable[[int], None]) -> None:
        self.url = f"null://{name}"
        self.dialect = SGLangDialect()
        self.label = str(boot_version)
        self.commits: list[tuple[int, float]] = []
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
        self._on_commit(version)
        return UpdateResult(message=f"null engine recorded v{version}", seconds=0.0)

    async def relabel(self, version: int) -> None:
        self.label = str(version)

    async def abort(self, rid: str) -> None:
        return None

    async def close(self) -> None:
        return None
