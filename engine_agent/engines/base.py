"""The engine port: the control operations the agent needs from an inference engine.

Owns the vocabulary of engine control (pause modes, what an update reports) and nothing
else. The data path (generate requests) is not part of the port: the proxy forwards those
bytes to `Engine.url` as they are. Adapters raise `EngineUnreachable` when the engine does
not answer and `EngineRefused` when it answers with an error; they never retry on their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum


class PauseMode(StrEnum):
    """How the agent pauses its engine for a commit.

    `in_place`: running requests keep their KV and continue on the new weights (SGLang's
    `in_place`). `quiesce`: the agent first drains in-flight requests (bounded), then pauses
    with SGLang's `retract` so any stragglers re-prefill on the new weights.
    """

    IN_PLACE = "in_place"
    QUIESCE = "quiesce"


@dataclass(frozen=True)
class EngineInfo:
    """What the engine says it serves (`/model_info`)."""

    model_path: str
    weight_version: str


@dataclass(frozen=True)
class UpdateResult:
    """An engine's reply to a weight update that succeeded."""

    message: str
    seconds: float


class Engine(ABC):
    """One inference engine, driven over its control API."""

    url: str

    @abstractmethod
    async def info(self) -> EngineInfo:
        """The served model path and weight-version label; cheap, answers while paused."""

    @abstractmethod
    async def pause(self, mode: PauseMode) -> None:
        """Stop scheduling generations (new ones block at the engine until `resume`)."""

    @abstractmethod
    async def resume(self) -> None:
        """Let generations run again."""

    @abstractmethod
    async def load_from_disk(self, model_path: str, version: int, mode: PauseMode) -> UpdateResult:
        """Load the checkpoint folder and label it `version`. Raise `EngineRefused` on failure."""

    @abstractmethod
    async def relabel(self, version: int) -> None:
        """Set the engine's weight-version label without touching weights or requests."""

    @abstractmethod
    async def abort(self, rid: str) -> None:
        """Abort the request `rid` (and, as SGLang does, every rid it prefixes)."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""
