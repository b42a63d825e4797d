"""`HTTPEngine`: what every adapter over an engine's HTTP API shares.

Owns one keep-alive client to the engine's control routes and the mapping of its failures
onto the port's errors: no answer → `EngineUnreachable`, an error status →
`EngineRefused` (with the status). Never retries and never interprets a reply's body.
"""

from __future__ import annotations

from typing import Any

import httpx

from engine_agent.engines.base import Engine
from engine_agent.errors import EngineRefused, EngineUnreachable
from store.sources.http import shared_tls


class HTTPEngine(Engine):
    """An engine server at `url`, e.g. `http://127.0.0.1:30000`, driven over HTTP."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        control_timeout_s: float = 30.0,
        load_timeout_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=control_timeout_s, verify=shared_tls()
        )
        self._load_timeout_s = load_timeout_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, **kwargs: Any
    ) -> httpx.Response:
        try:
            reply = await self._client.request(method, path, json=body, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineUnreachable(
                f"{self.kind} engine at {self.url} did not answer {method} {path}: "
                f"{type(exc).__name__}: {exc}; check that the engine process is running"
            ) from exc
        if reply.status_code >= 400:
            raise EngineRefused(
                f"{self.kind} engine at {self.url} answered {method} {path} with "
                f"{reply.status_code}: {reply.text[:500]}",
                reply.status_code,
            )
        return reply

    async def close(self) -> None:
        await self._client.aclose()
