"""`ControlClient`: the agent's side of the control plane's engine API.

Owns the calls an engine makes (register, heartbeat, target long-poll, deregister, and for
peer-assisted fetch: its fetch plan, a peer report, another token's role) with
the wire models of `wire`, and their failure mapping: 404 on an engine route
→ `EngineNotRegistered` (register again), anything else unexpected →
`ControlPlaneUnavailable`. Also owns fail-over between control-plane replicas: it keeps
calling the one that answered last and moves on to the next URL when that one does not
answer or answers 5xx (replicas share one database, so engine ids hold on every one).
Must never import the control plane's server modules.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from engine_agent.errors import ControlPlaneUnavailable, EngineNotRegistered
from store.sources.http import shared_tls
from wire import (
    EngineRegister,
    EngineRegistered,
    Heartbeat,
    HeartbeatReply,
    Role,
    TargetReply,
)
from wire.peers import FetchPlan, PeerReport, TokenIdentity

log = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=BaseModel)

# How long an idle connection to the control plane is kept for the next call: longer than
# a heartbeat interval or the time between versions, so that beats and fetch plans reuse
# connections instead of opening one each (httpx's default, 5 s, is shorter than the
# intervals a large fleet runs, e.g. 10 s: a TCP connect and an accept per beat, on the
# agent's loop and the control plane's), and shorter than the control
# plane's own keep-alive (65 s, `controlplane.serving`), so the agent never reuses one the
# server is closing. A connection the other side closed meanwhile (a proxy's shorter idle
# timeout) is seen as closed before reuse and replaced; one dropped silently fails that
# one call as an unreachable control plane would (a heartbeat retries, a long-poll asks
# again, a fetch plan falls back to the store).
KEEPALIVE_S = 60.0


class _ReplicaDown(ControlPlaneUnavailable):
    """This replica did not answer or answered 5xx: another one may."""


class ControlClient:
    """Calls the control plane at `urls` (one or several replicas) with an engine-role
    bearer `token`."""

    def __init__(
        self,
        urls: str | list[str],
        token: str | None,
        timeout_s: float = 10.0,
        event_hooks: dict[str, list[Any]] | None = None,
    ) -> None:
        """`event_hooks` are httpx's (e.g. a benchmark timing each call)."""
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("ControlClient needs at least one control-plane URL")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._clients = [
            # The process's one TLS context: loading the CA bundle per client costs 0.1 s
            # of CPU on the event loop (many agents in one process start together).
            httpx.AsyncClient(
                base_url=u,
                headers=headers,
                timeout=timeout_s,
                event_hooks=event_hooks,
                verify=shared_tls(),
                limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
            )
            for u in self.urls
        ]
        self._current = 0

    @property
    def url(self) -> str:
        """The control plane the agent talks to now."""
        return self.urls[self._current]

    async def _call(
        self,
        method: str,
        path: str,
        reply_model: type[Reply] | None,
        body: BaseModel | None = None,
        **kwargs: Any,
    ) -> Reply | None:
        """`_call_one` on the current replica, then on each other one until one answers."""
        first = self._current
        for step in range(len(self.urls)):
            index = (first + step) % len(self.urls)
            try:
                reply = await self._call_one(index, method, path, reply_model, body, **kwargs)
            except _ReplicaDown as exc:
                if step == len(self.urls) - 1:
                    raise
                log.warning("%s; trying %s", exc, self.urls[(index + 1) % len(self.urls)])
                continue
            if index != self._current:
                log.info("control plane: now talking to %s", self.urls[index])
                self._current = index
            return reply
        raise AssertionError("unreachable: the loop returns or raises")

    async def _call_one(
        self,
        index: int,
        method: str,
        path: str,
        reply_model: type[Reply] | None,
        body: BaseModel | None = None,
        **kwargs: Any,
    ) -> Reply | None:
        url = self.urls[index]
        try:
            reply = await self._clients[index].request(
                method,
                path,
                content=body.model_dump_json() if body is not None else None,
                headers={"content-type": "application/json"} if body is not None else None,
                **kwargs,
            )
        except httpx.HTTPError as exc:
            raise _ReplicaDown(
                f"control plane at {url} did not answer {method} {path}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if reply.status_code == 404 and path.startswith("/v1/engines/"):
            raise EngineNotRegistered(
                f"control plane at {url} does not know this engine ({path}): {reply.text[:300]}"
            )
        if reply.status_code >= 400:
            # A 4xx is this request's fault and another replica would say the same; a 5xx
            # (e.g. 503 while the database is away) is worth another replica.
            failure = _ReplicaDown if reply.status_code >= 500 else ControlPlaneUnavailable
            raise failure(
                f"control plane at {url} answered {method} {path} with "
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

    async def fetch_plan(self, engine_id: str, version: int, since: int | None = None) -> FetchPlan:
        """The peers to fetch `version`'s files from, in lanes, with the version's claim and
        index when the control plane has them, and (`since`: the version the engine holds)
        those of the versions between, and their own lanes (docs/peers.md)."""
        params: dict[str, Any] = {"version": version, "planning": "true", "lanes": "true"}
        if since is not None:
            params.update(since=since, version_lanes="true")
        reply = await self._call(
            "GET", f"/v1/engines/{engine_id}/fetch-plan", FetchPlan, params=params
        )
        assert reply is not None
        return reply

    async def report_peer(self, engine_id: str, report: PeerReport) -> None:
        await self._call("POST", f"/v1/engines/{engine_id}/peer-reports", None, report)

    async def token_role(self, authorization: str) -> Role | None:
        """The role of another caller's bearer token (a peer asking for files), or None
        if the control plane does not know it. Raise `ControlPlaneUnavailable` if no
        control plane answers."""
        client = self._clients[self._current]
        try:
            reply = await client.get("/v1/tokens/self", headers={"Authorization": authorization})
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(
                f"control plane at {self.url} did not answer the token check: {exc}"
            ) from exc
        if reply.status_code in (401, 403):
            return None
        if reply.status_code != 200:
            raise ControlPlaneUnavailable(
                f"control plane at {self.url} answered the token check with {reply.status_code}"
            )
        return TokenIdentity.model_validate_json(reply.content).role

    async def deregister(self, engine_id: str) -> None:
        try:
            await self._call("DELETE", f"/v1/engines/{engine_id}", None)
        except EngineNotRegistered:
            log.info("engine %s was already gone from %s", engine_id, self.url)

    async def close(self) -> None:
        for client in self._clients:
            await client.aclose()
