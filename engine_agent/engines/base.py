"""The engine port: what the agent needs from an inference engine, whatever its kind.

Owns the vocabulary of engine control (pause modes, what an update reports) and of the data
path (`Dialect`: how a rollout request in the agent's contract — SGLang's native
`/generate` shape and the OpenAI routes — becomes the engine's own request, and how its
answer comes back in that contract). Adapters raise `EngineUnreachable` when the engine
does not answer, `EngineRefused` when it answers with an error and `EngineIncompatible`
(from `check`) when it cannot serve the agent at all; they never retry on their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import httpx

# Tether's routing fields: read by the proxy, never forwarded to an engine.
TETHER_FIELDS = ("weight_version", "precision", "session_id", "run_id")


class PauseMode(StrEnum):
    """How the agent pauses its engine for a commit.

    `in_place`: running requests keep their KV and continue on the new weights (SGLang's
    `in_place`). `quiesce`: the agent first drains in-flight requests (bounded), then pauses
    with SGLang's `retract` so any stragglers re-prefill on the new weights.
    """

    IN_PLACE = "in_place"
    QUIESCE = "quiesce"


@dataclass(frozen=True)
class ModelInfo:
    """What the engine says it serves (`/model_info`)."""

    model_path: str
    weight_version: str


@dataclass(frozen=True)
class UpdateResult:
    """An engine's reply to a weight update that succeeded."""

    message: str
    seconds: float


def namespace_key(version: int, client_key: Any) -> str:
    """The prefix-cache namespace an engine sees: the served version first, the client's
    key after, so a prefix computed under one version never serves another."""
    return f"tether-v{version}" + (f":{client_key}" if client_key else "")


class UnsupportedRequest(ValueError):
    """A rollout request this engine kind cannot serve; the message names the field."""


@dataclass
class EngineRequest:
    """One rollout request translated for the engine: where to send what, the ids that
    abort it, and what the answer's translation needs to remember."""

    path: str
    body: dict[str, Any]
    rids: list[str]
    context: dict[str, Any] = field(default_factory=dict)


class Dialect(ABC):
    """How the agent's generate routes map onto one engine's HTTP routes."""

    @abstractmethod
    async def request(
        self, path: str, body: dict[str, Any], version: int, client: httpx.AsyncClient
    ) -> EngineRequest:
        """Translate `body` (Tether's fields already read) for the engine, namespacing its
        prefix cache by `version`. Raise `UnsupportedRequest` for what it cannot serve."""

    @abstractmethod
    def reply(self, call: EngineRequest, payload: Any) -> Any:
        """The engine's JSON answer in the agent's contract."""

    @abstractmethod
    def stream(self, call: EngineRequest) -> Callable[[Any], Any]:
        """A translator for the SSE chunks of one streamed answer (None drops a chunk)."""

    @abstractmethod
    async def abort(self, client: httpx.AsyncClient, rids: list[str]) -> None:
        """Abort the engine requests of a client that went away."""


class Engine(ABC):
    """One inference engine, driven over its control API."""

    url: str
    kind: ClassVar[str]
    """What the router and `/server_info` call this engine kind (`sglang`, `vllm`)."""
    dialect: Dialect

    @abstractmethod
    async def check(self) -> None:
        """Raise `EngineIncompatible`, naming the fix, if the engine cannot serve the agent
        (called once at agent start, after the engine first answers)."""

    @abstractmethod
    async def info(self) -> ModelInfo:
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
