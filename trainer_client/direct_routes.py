"""Client-side balancing: call engines directly from the control plane's candidate sets.

Owns the direct mode of `RolloutClient` (`direct=True`): it asks `GET /v1/routes` for every
engine that may serve a constraint, reuses that answer for its `valid_for_s`, picks the
less loaded of two random candidates by this client's own in-flight counts over each
engine's capacity, and posts the generate body straight to the engine. An engine that
answers 409 or 503, or cannot be reached, is dropped from every cached set at once and
the next candidate is tried (at most `attempts` engines per call); a set left empty is
asked for again. With a session id it asks `GET /v1/route` instead, so the router's
rendezvous hashing keeps the session on its engine.

It never decides eligibility (the control plane does) and never enforces the version:
the engine's agent checks the request's `weight_version` under its own lock and answers
409 when it no longer serves it, and `RolloutClient` checks the stamped answer.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from store.types import VersionConstraint
from wire import RouteAnswer, RouteCandidate, RouteSet

# The router's generate route -> the engine path it forwards to (the agent serves SGLang's).
ENGINE_PATHS = {
    "/v1/generate": "/generate",
    "/v1/completions": "/v1/completions",
    "/v1/chat/completions": "/v1/chat/completions",
}
# Answers from an engine that say "another engine may serve this": drop it and move on.
ENGINE_RETRY_STATUSES = frozenset({409, 503})

# (run_id, min_version, exact_version, precisions): one cached candidate set each.
RouteKey = tuple[str | None, int | None, int | None, tuple[str, ...]]


@dataclass
class CandidateSet:
    """One constraint's engines as the control plane listed them, minus those dropped."""

    engines: list[RouteCandidate]
    expires_at: float


@dataclass
class DirectStats:
    """What the direct mode did: control-plane reads, engine calls, engines dropped."""

    route_lookups: int = 0
    engine_calls: int = 0
    engines_dropped: int = 0


class DirectRoutes:
    """Balances generate requests over engines from cached `GET /v1/routes` answers.

    `control`: a client of the control plane (base URL and token set); `engines`: the
    client that calls engines (no token: the agent's generate front takes none).
    """

    def __init__(
        self,
        control: httpx.AsyncClient,
        engines: httpx.AsyncClient,
        *,
        attempts: int = 3,
        rng: random.Random | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be 1 or more, got {attempts}")
        self.control = control
        self.engines = engines
        self.attempts = attempts
        self.rng = rng or random.Random()
        self.in_flight: dict[str, int] = {}
        self.stats = DirectStats()
        self._sets: dict[RouteKey, CandidateSet] = {}
        self._asking: dict[RouteKey, asyncio.Lock] = {}

    async def post(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        run_id: str | None,
        constraint: VersionConstraint,
        precisions: tuple[str, ...] = (),
        session_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[httpx.Response, RouteCandidate | None]:
        """The engine's answer and the engine that gave it; or the control plane's
        refusal (404/409/422/503, engine None) when it lists no engine. Raises the last
        `httpx.TransportError` when every engine tried was unreachable."""
        engine_path = ENGINE_PATHS[path]
        key: RouteKey = (run_id, constraint.min_version, constraint.exact_version, precisions)
        last: httpx.Response | httpx.TransportError | None = None
        last_engine: RouteCandidate | None = None
        for _ in range(self.attempts):
            found: list[RouteCandidate] | RouteCandidate | httpx.Response
            if session_id is not None:
                found = await self._route_for_session(key, session_id)
                engine = found if isinstance(found, RouteCandidate) else None
            else:
                found = await self._candidates(key)
                engine = self._pick(found) if isinstance(found, list) else None
            if isinstance(found, httpx.Response):
                return found, None
            if engine is None:  # the set came back empty: ask again
                self._sets.pop(key, None)
                continue
            try:
                response = await self._call(engine, engine_path, body, headers)
            except httpx.TransportError as exc:
                self._drop(engine.engine_id)
                last, last_engine = exc, engine
                continue
            if response.status_code in ENGINE_RETRY_STATUSES:
                self._drop(engine.engine_id)
                last, last_engine = response, engine
                continue
            return response, engine
        if isinstance(last, httpx.TransportError):
            raise last
        if last is None:  # the control plane listed no engine, every time it was asked
            return _no_engine_listed(path), None
        return last, last_engine

    # ------------------------------------------------------------------ candidates

    async def _candidates(self, key: RouteKey) -> list[RouteCandidate] | httpx.Response:
        cached = self._fresh(key)
        if cached is not None:
            return cached
        # One ask per lapsed set: requests that arrive meanwhile wait for its answer.
        lock = self._asking.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._fresh(key)
            if cached is not None:
                return cached
            return await self._refetch(key)

    def _fresh(self, key: RouteKey) -> list[RouteCandidate] | None:
        cached = self._sets.get(key)
        if cached is not None and cached.engines and time.monotonic() < cached.expires_at:
            return cached.engines
        return None

    async def _refetch(self, key: RouteKey) -> list[RouteCandidate] | httpx.Response:
        self.stats.route_lookups += 1
        response = await self.control.get("/v1/routes", params=_query(key))
        if response.status_code != 200:
            self._sets.pop(key, None)
            return response
        found = RouteSet.model_validate_json(response.content)
        self._sets[key] = CandidateSet(found.engines, time.monotonic() + found.valid_for_s)
        return found.engines

    async def _route_for_session(
        self, key: RouteKey, session_id: str
    ) -> RouteCandidate | httpx.Response:
        """The router's affinity pick for the session (not cached: one engine per ask)."""
        self.stats.route_lookups += 1
        params = [("session_id", session_id), *_query(key)]
        response = await self.control.get("/v1/route", params=params)
        if response.status_code != 200:
            return response
        answer = RouteAnswer.model_validate_json(response.content)
        return RouteCandidate(
            engine_id=answer.engine_id,
            url=answer.url,
            precision=answer.precision,
            applied_version=answer.applied_version,
            capacity=1,
            in_flight=0,
        )

    def _pick(self, engines: list[RouteCandidate]) -> RouteCandidate | None:
        return pick_less_loaded(engines, self.in_flight, self.rng)

    def _drop(self, engine_id: str) -> None:
        """Leave an engine out of every cached set until the control plane lists it again."""
        self.stats.engines_dropped += 1
        for cached in self._sets.values():
            cached.engines = [e for e in cached.engines if e.engine_id != engine_id]

    async def _call(
        self,
        engine: RouteCandidate,
        engine_path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str] | None,
    ) -> httpx.Response:
        engine_id = engine.engine_id
        self.in_flight[engine_id] = self.in_flight.get(engine_id, 0) + 1
        self.stats.engine_calls += 1
        try:
            return await self.engines.post(
                engine.url.rstrip("/") + engine_path, json=dict(body), headers=dict(headers or {})
            )
        finally:
            left = self.in_flight[engine_id] - 1
            if left:
                self.in_flight[engine_id] = left
            else:
                del self.in_flight[engine_id]


QueryList = list[tuple[str, str | int | float | bool | None]]


def _query(key: RouteKey) -> QueryList:
    """The query of `/v1/routes` and `/v1/route` for one constraint."""
    run_id, min_version, exact_version, precisions = key
    params: QueryList = [
        (name, value)
        for name, value in (
            ("run_id", run_id),
            ("min_version", min_version),
            ("exact_version", exact_version),
        )
        if value is not None
    ]
    params.extend(("precision", p) for p in precisions)
    return params


def _no_engine_listed(path: str) -> httpx.Response:
    """A retryable 503 in the router's shape, for an empty candidate set (the control plane
    refuses rather than list none, so only a race with its snapshot gets here)."""
    message = f"{path}: the control plane listed no engine to call directly; retry"
    error = {"type": "NoEngineAvailable", "retryable": True, "message": message}
    return httpx.Response(503, json={"error": error})


def pick_less_loaded(
    engines: list[RouteCandidate], in_flight: Mapping[str, int], rng: random.Random
) -> RouteCandidate | None:
    """Power of two choices: of two distinct random candidates, the one with fewer of this
    client's requests in flight per unit of capacity (the first drawn of equals)."""
    if not engines:
        return None
    if len(engines) == 1:
        return engines[0]
    one, two = rng.sample(engines, 2)
    load_one = in_flight.get(one.engine_id, 0) / max(1, one.capacity)
    load_two = in_flight.get(two.engine_id, 0) / max(1, two.capacity)
    return two if load_two < load_one else one


def stamp(answer: Any, engine: RouteCandidate) -> Any:
    """The engine's JSON answer with `engine_id` and `precision` added, as the router adds
    them to what it relays (the agent already stamps the versions)."""
    if isinstance(answer, dict):
        answer.setdefault("engine_id", engine.engine_id)
        answer.setdefault("precision", str(engine.precision))
    return answer
