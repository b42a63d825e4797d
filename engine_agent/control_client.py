"""`ControlClient`: the agent's side of the control plane's engine API.

Owns the calls an engine makes (register, heartbeat, target long-poll, deregister, and for
peer-assisted fetch: its fetch plan, a peer report, another token's role) with
the wire models of `wire`, and their failure mapping: 404 on an engine route
→ `EngineNotRegistered` (register again), anything else unexpected →
`ControlPlaneUnavailable`. Also owns fail-over between control-plane replicas: it keeps
calling the one that answered last and moves on to the next URL when that one does not
answer or answers 5xx (replicas share one database, so engine ids hold on every one).
Calls go through Tether's own HTTP/1.1 client (`http1`), a tenth or less of httpx's CPU per
call (`bench/http_cost.py`): a thousand agents in one process spend their time on their
work, not on heartbeats. Where the environment routes a control-plane URL through a proxy
(`HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY` without a matching `NO_PROXY`), that URL's calls go
through httpx, which speaks to proxies, as they always did. Must never import the control
plane's server modules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlencode, urlsplit

import httpx
from pydantic import BaseModel

from engine_agent.errors import ControlPlaneUnavailable, EngineNotRegistered
from http1.client import Upstream, UpstreamError, proxied
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
# Connections one agent may hold open to one replica: a parked long-poll, a heartbeat, a
# fetch plan, a peer report and token checks for its peers at once.
MAX_CONNECTIONS = 64

Headers = tuple[tuple[str, str], ...]
# Told of every answer: (method, path without query, status, seconds, body). For
# benchmarks timing the calls.
AnswerHook = Callable[[str, str, int, float, bytes], None]


class _ReplicaDown(ControlPlaneUnavailable):
    """This replica did not answer or answered 5xx: another one may."""


class _Transport(Protocol):
    async def send(
        self, method: str, target: str, body: bytes, headers: Headers, timeout_s: float | None
    ) -> tuple[int, bytes]:
        """(status, body) of one call; `UpstreamError` when the replica did not answer."""
        ...

    async def close(self) -> None: ...


class _Lean:
    """A replica reached through `http1`'s keep-alive pool (made on the first call of each
    event loop: it belongs to the loop)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._pool: Upstream | None = None

    async def send(
        self, method: str, target: str, body: bytes, headers: Headers, timeout_s: float | None
    ) -> tuple[int, bytes]:
        if self._pool is None or self._pool.loop is not asyncio.get_running_loop():
            # The first call, or one from another event loop than the pool's (a pool's
            # connections belong to the loop they were opened on).
            self._pool = Upstream(
                read_timeout_s=self.timeout_s,
                connect_timeout_s=self.timeout_s,
                keepalive_s=KEEPALIVE_S,
                max_connections=MAX_CONNECTIONS,
                # The process's one TLS context: loading the CA bundle per client costs
                # 0.1 s of CPU on the event loop (many agents in one process start together).
                ssl_context=shared_tls() if self.url.startswith("https:") else None,
            )
        answer = await self._pool.request(method, self.url, target, body, headers, timeout_s)
        return answer.status, answer.body

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()


class _Proxied:
    """A replica the environment says to reach through a proxy: httpx, which speaks to it."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._client = httpx.AsyncClient(
            base_url=url,
            timeout=timeout_s,
            verify=shared_tls(),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )

    async def send(
        self, method: str, target: str, body: bytes, headers: Headers, timeout_s: float | None
    ) -> tuple[int, bytes]:
        try:
            reply = await self._client.request(
                method,
                target,
                content=body or None,
                headers=dict(headers),
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
        return reply.status_code, reply.content

    async def close(self) -> None:
        await self._client.aclose()


class ControlClient:
    """Calls the control plane at `urls` (one or several replicas) with an engine-role
    bearer `token`."""

    def __init__(
        self,
        urls: str | list[str],
        token: str | None,
        timeout_s: float = 10.0,
        on_answer: AnswerHook | None = None,
    ) -> None:
        """`timeout_s`: to connect, and the longest silence within an answer (a long-poll
        adds its own wait); `on_answer` is told of every answer (a benchmark timing calls)."""
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("ControlClient needs at least one control-plane URL")
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
                raise ValueError(
                    f"control-plane URL {url!r}: expected http://host:port or https://host "
                    "(no user or password: the agent authenticates with its token)"
                )
        self._auth: Headers = (("Authorization", f"Bearer {token}"),) if token else ()
        self._transports: list[_Transport] = [
            _Proxied(u, timeout_s) if proxied(u) else _Lean(u, timeout_s) for u in self.urls
        ]
        self._on_answer = on_answer
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
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Reply | None:
        """`_call_one` on the current replica, then on each other one until one answers."""
        first = self._current
        for step in range(len(self.urls)):
            index = (first + step) % len(self.urls)
            try:
                reply = await self._call_one(
                    index, method, path, reply_model, body, params, timeout_s
                )
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
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        headers: Headers | None = None,
    ) -> Reply | None:
        url = self.urls[index]
        status, content = await self._send(index, method, path, body, params, timeout_s, headers)
        if status == 404 and path.startswith("/v1/engines/"):
            raise EngineNotRegistered(
                f"control plane at {url} does not know this engine ({path}): {_text(content, 300)}"
            )
        if status >= 400:
            # A 4xx is this request's fault and another replica would say the same; a 5xx
            # (e.g. 503 while the database is away) is worth another replica.
            failure = _ReplicaDown if status >= 500 else ControlPlaneUnavailable
            raise failure(
                f"control plane at {url} answered {method} {path} with "
                f"{status}: {_text(content, 500)}"
            )
        return reply_model.model_validate_json(content) if reply_model else None

    async def _send(
        self,
        index: int,
        method: str,
        path: str,
        body: BaseModel | None,
        params: dict[str, Any] | None,
        timeout_s: float | None,
        headers: Headers | None = None,
    ) -> tuple[int, bytes]:
        """(status, body) from replica `index`; `_ReplicaDown` if it did not answer."""
        target = f"{path}?{urlencode(params)}" if params else path
        data = body.model_dump_json().encode() if body is not None else b""
        started = time.perf_counter()
        try:
            status, content = await self._transports[index].send(
                method, target, data, self._auth if headers is None else headers, timeout_s
            )
        except UpstreamError as exc:
            raise _ReplicaDown(
                f"control plane at {self.urls[index]} did not answer {method} {path}: {exc}"
            ) from exc
        if self._on_answer is not None:
            self._on_answer(method, path, status, time.perf_counter() - started, content)
        return status, content

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
            timeout_s=timeout_s + 10.0,
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
        if any(c in authorization for c in "\r\n\0"):
            return None  # no token has line breaks; it would not fit in a header either
        try:
            status, content = await self._send(
                self._current,
                "GET",
                "/v1/tokens/self",
                None,
                None,
                None,
                (("Authorization", authorization),),
            )
        except _ReplicaDown as exc:
            raise ControlPlaneUnavailable(f"the token check failed: {exc}") from exc
        if status in (401, 403):
            return None
        if status != 200:
            raise ControlPlaneUnavailable(
                f"control plane at {self.url} answered the token check with {status}"
            )
        return TokenIdentity.model_validate_json(content).role

    async def deregister(self, engine_id: str) -> None:
        try:
            await self._call("DELETE", f"/v1/engines/{engine_id}", None)
        except EngineNotRegistered:
            log.info("engine %s was already gone from %s", engine_id, self.url)

    async def close(self) -> None:
        for transport in self._transports:
            await transport.close()


def _text(content: bytes, limit: int) -> str:
    return content[:limit].decode("utf-8", "replace")
