"""Errors of the engine agent, named by their recovery boundary.

- `StageFailed`: a version could not be prepared (missing, corrupt, not convertible). The
  engine never saw it and keeps serving its old weights; the reconciler retries with backoff.
- `EngineUnreachable`: the engine does not answer. The agent reports it and leaves routing;
  it comes back by itself if the engine does.
- `UnrecoverableEngineError`: the engine refused or crashed during a commit, so what it
  serves is unknown. Replace the replica; never retry on it.
- `EngineIncompatible`: the engine cannot serve the agent (too old, or started without the
  routes the agent needs). Found at agent start; the message names the fix.
- `EngineNotRegistered`: the control plane forgot this engine (lease lapsed); register again.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class for every error the engine agent raises."""


class StageFailed(AgentError):
    """Preparing a version failed before anything reached the engine. Retry later."""


class EngineUnreachable(AgentError):
    """The engine did not answer over HTTP (refused, timed out, or reset)."""


class EngineRefused(AgentError):
    """The engine answered a control call with an error status (`status`)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineIncompatible(AgentError):
    """The engine lacks what the agent needs (version, routes); fix how it is started."""


class UnrecoverableEngineError(AgentError):
    """A commit failed part way: the engine's weights are undefined. Replace the replica."""


class EngineNotRegistered(AgentError):
    """The control plane answered 404 for this engine id: register again."""


class ControlPlaneUnavailable(AgentError):
    """The control plane did not answer or answered with an unexpected status."""
