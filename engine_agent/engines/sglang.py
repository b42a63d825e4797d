"""`SGLangEngine`: the engine port over SGLang's HTTP API (sglang-api spec §5).

Works with SGLang 0.5.17+ and the CPU reference engine, which speaks the same subset. The
commit sequence it implements is `/pause_generation` → `/update_weights_from_disk` →
`/continue_generation`; it never sends `flush_cache: true` under `in_place` (that fails, or
crashes SGLang ≤0.5.21, while requests are running) and relies on `extra_key` namespacing
instead. Must never decide when to update: that is the reconciler's job.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from engine_agent.engines.base import (
    Dialect,
    EngineRequest,
    ModelInfo,
    PauseMode,
    UpdateResult,
    namespace_key,
)
from engine_agent.engines.http import HTTPEngine
from engine_agent.errors import EngineRefused

log = logging.getLogger(__name__)

# SGLang pause mode used for each of the agent's modes.
_SGLANG_PAUSE = {PauseMode.IN_PLACE: "in_place", PauseMode.QUIESCE: "retract"}


def prepare_body(body: dict[str, Any], version: int) -> list[str]:
    """Namespace `extra_key` by `version`, make sure there is a `rid`; return the rids to
    abort if the client leaves (SGLang's abort matches rid prefixes)."""
    key = body.get("extra_key")
    if isinstance(key, list):
        body["extra_key"] = [namespace_key(version, k) for k in key]
    else:
        body["extra_key"] = namespace_key(version, key)
    rid = body.get("rid")
    if rid is None:
        rid = body["rid"] = f"tether-{uuid.uuid4().hex}"
    return [str(r) for r in rid] if isinstance(rid, list) else [str(rid)]


class SGLangDialect(Dialect):
    """SGLang's routes are the agent's contract: bodies pass as they are, but for the
    `extra_key` namespace and a `rid`."""

    async def request(
        self, path: str, body: dict[str, Any], version: int, client: httpx.AsyncClient
    ) -> EngineRequest:
        return EngineRequest(path, body, prepare_body(body, version))

    def reply(self, call: EngineRequest, payload: Any) -> Any:
        return payload

    def stream(self, call: EngineRequest) -> Callable[[Any], Any]:
        return lambda payload: payload

    async def abort(self, client: httpx.AsyncClient, rids: list[str]) -> None:
        for rid in rids:
            try:
                await client.post("/abort_request", json={"rid": rid}, timeout=5.0)
            except httpx.HTTPError as exc:
                log.warning("could not abort %s at the engine: %s", rid, exc)


class SGLangEngine(HTTPEngine):
    """An SGLang (or reference) server at `url`, e.g. `http://127.0.0.1:30000`."""

    kind = "sglang"
    dialect = SGLangDialect()

    _info_path = "/model_info"

    async def check(self) -> None:
        # Every route the adapter uses exists in every release it supports (0.5.17+); a
        # server that answers `/model_info` serves the agent.
        return None

    async def info(self) -> ModelInfo:
        # `/model_info` is the route; `/get_model_info` is its deprecated alias and the only
        # name on older builds, so a 404 falls back to it once and for all.
        # (`/get_weight_version` and `/weight_version` never answer with a version.)
        try:
            reply = await self._call("GET", self._info_path)
        except EngineRefused as exc:
            if self._info_path != "/model_info" or exc.status != 404:
                raise
            self._info_path = "/get_model_info"
            reply = await self._call("GET", self._info_path)
        body = reply.json()
        return ModelInfo(
            model_path=str(body.get("model_path") or ""),
            weight_version=str(body.get("weight_version") or ""),
        )

    async def pause(self, mode: PauseMode) -> None:
        await self._call("POST", "/pause_generation", {"mode": _SGLANG_PAUSE[mode]})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {"torch_empty_cache": False})

    async def load_from_disk(self, model_path: str, version: int, mode: PauseMode) -> UpdateResult:
        body = {
            "model_path": model_path,
            "weight_version": str(version),
            # Flushing while in_place-paused requests hold KV fails; extra_key isolates instead.
            "flush_cache": mode is not PauseMode.IN_PLACE,
            "abort_all_requests": False,
        }
        started = time.perf_counter()
        reply = await self._call(
            "POST", "/update_weights_from_disk", body, timeout=self._load_timeout_s
        )
        payload = reply.json()
        if not payload.get("success", False):
            raise EngineRefused(
                f"engine at {self.url} did not load {model_path}: {payload.get('message')}"
            )
        return UpdateResult(str(payload.get("message", "")), time.perf_counter() - started)

    async def relabel(self, version: int) -> None:
        body = {"new_version": str(version), "abort_all_requests": False}
        await self._call("POST", "/update_weight_version", body)

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})
