"""`ControlClient`: the agent's side of the control plane's engine API.

Owns the four calls an engine makes (register, heartbeat, target long-poll, deregister) with
the wire models of `wire`, and their failure mapping: 404 on an engine route
→ `EngineNotRegistered` (register again), anything else unexpected →
`ControlPlaneUnavailable`. Must never import the control plane's server modules.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from engine_agent.errors import ControlPlaneUnavailable, EngineNotRegistered
from wire import (
    EngineRegister,
    EngineRegistered,
    Heartbeat,
    HeartbeatReply,
    TargetReply,
)

log = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=BaseModel)


class ControlClient:
    """Calls the control plane at `url` with an engine-role bearer `token`."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s)

    async def _call(
        self,
        method: str,
        path: str,
        reply_model: type[Reply] | None,
        body: BaseModel | None = None,
        **kwargs: Any,
    ) -> Reply | None:
        try:
            reply = await self._client.request(
                method,
                path,
                content=body.model_dump_json() if body is not None else None,
                headers={"content-type": "application/json"} if body is not None else None,
                **kwargs,
            )
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(
                f"control plane at {self.url} did not answer {method} {path}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if reply.status_code == 404 and path.startswith("/v1/engines/"):
            raise EngineNotRegistered(
                f"control plane at {self.url} does not know this engine ({path}): "
                f"{reply.text[:300]}"
            )
        if reply.status_code >= 400:
            raise ControlPlaneUnavailable(
                f"control plane at {self.url} answered {method} {path} with "
                f"{reply.status_code}: {reply.text[:500]}"
            )
        return reply_model.model_validate_json(reply.content) if reply_model else None

    async def register(self, body: EngineRegister) -> EngineRegistered:
        reply = await self._call("POST", "/v1/engines", EngineRegistered, body)
        assert reply is not None
        return reply

    async def heartbeat(self, engine_id: str, body: Heartbeat) -> HeartbeatReply:
        reply = await self._call("POST", f"/v1/engines/{engine_id}/heartbeat", HeartbeatReply, body)
        assert reply is not None
        return reply

    async def wait_target(self, engine_id: str, after: int | None, timeout_s: float) -> TargetReply:
        """Long-poll until the engine's target differs from `after` (or `timeout_s`)."""
        params: dict[str, Any] = {"timeout": timeout_s}
        if after is not None:
            params["after"] = after
        reply = await self._call(
            "GET",
            f"/v1/engines/{engine_id}/target",
            TargetReply,
            params=params,
            timeout=timeout_s + 10.0,
        )
        assert reply is not None
        return reply

    async def deregister(self, engine_id: str) -> None:
        try:
            await self._call("DELETE", f"/v1/engines/{engine_id}", None)
        except EngineNotRegistered:
            log.info("engine %s was already gone from %s", engine_id, self.url)

    async def close(self) -> None:
        await self._client.aclose()
