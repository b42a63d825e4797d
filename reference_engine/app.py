"""HTTP surface of the reference engine: SGLang's native routes with its bodies and shapes.

Owns request parsing and response shapes for `/generate`, the control routes (pause,
continue, update from disk, relabel, flush, abort), health and info routes, and SGLang's
error envelopes (validation → 400 `{"object":"error",...}`; generate errors → 400
`{"error":{"message"}}`; the 0.5.22+ sampling contract gate → 400 `{"error": "<text>"}`).
The OpenAI routes live in `reference_engine.openai_routes`. Must never run the
model directly: everything goes through `ReferenceEngine`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from reference_engine.engine import ReferenceEngine, RequestSpec
from reference_engine.sampling import SamplingParamsError, parse_sampling_params
from reference_engine.scheduler import DuplicateRequest
from reference_engine.settings import ReferenceEngineSettings

log = logging.getLogger(__name__)

ENGINE_VERSION = "tether-reference-0.1.0"
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    torch_empty_cache: bool = True


class UpdateFromDiskBody(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False


class UpdateWeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True


class AbortBody(_Body):
    rid: str = ""
    abort_all: bool = False


class WeightsByNameBody(_Body):
    name: str
    truncate_size: int = 100


class WeightsCheckerBody(_Body):
    action: str = "checksum"


def generate_error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _as_list(value: Any, count: int) -> list:
    return value if isinstance(value, list) else [value] * count


def build_specs(engine: ReferenceEngine, body: dict) -> tuple[list[RequestSpec], bool]:
    """Native `/generate` body → one spec per prompt (× n); and whether it was a batch."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("Either text or input_ids should be provided, and not both.")
    if text is not None:
        batch = isinstance(text, list)
        prompts = [engine.encode(t) for t in (text if batch else [text])]
    else:
        assert input_ids is not None  # exactly one of the two, checked above
        batch = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batch else [input_ids]
    vocab = engine.config.get("vocab_size", 0)
    if not all(isinstance(t, int) and 0 <= t < vocab for p in prompts for t in p):
        raise ValueError(f"input_ids must be lists of token ids in [0, {vocab})")
    if any(not p for p in prompts):
        raise ValueError("a prompt must hold at least one token")
    count = len(prompts)
    raw_params = _as_list(body.get("sampling_params") or {}, count)
    params = [parse_sampling_params(p) for p in raw_params]
    copies = params[0].n if params else 1
    batch = batch or copies > 1
    rid = body.get("rid")
    total = count * copies
    if isinstance(rid, list):
        rids = rid
    elif rid is not None:
        rids = [rid] if total == 1 else [f"{rid}_{i}" for i in range(total)]
    else:
        rids = [uuid.uuid4().hex for _ in range(total)]
    if len(rids) != total:
        raise ValueError(f"expected {total} rids, found {len(rids)}")
    specs = []
    for i in range(total):
        which = i // copies
        specs.append(
            RequestSpec(
                input_ids=list(prompts[which]),
                params=params[which],
                rid=rids[i],
                return_logprob=bool(_as_list(body.get("return_logprob"), count)[which]),
                top_logprobs_num=int(_as_list(body.get("top_logprobs_num") or 0, count)[which]),
                logprob_start_len=int(_as_list(body.get("logprob_start_len", -1), count)[which]),
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                extra_key=_as_list(body.get("extra_key"), count)[which] or None,
            )
        )
    for spec in specs:
        if spec.logprob_start_len > len(spec.input_ids):
            raise ValueError(
                f"logprob_start_len ({spec.logprob_start_len}) is larger than the prompt "
                f"({len(spec.input_ids)} tokens)"
            )
    return specs, batch


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def watch_disconnect(request: Request) -> None:
    """Return once the client has gone away (non-streaming requests)."""
    while not await request.is_disconnected():
        # is_disconnected() only peeks; waiting on receive() would steal body messages.
        await asyncio.sleep(0.25)


async def collect(engine: ReferenceEngine, specs: list[RequestSpec], request: Request) -> list:
    """Run specs to completion; abort them if the client disconnects first."""
    results: list[dict | None] = [None] * len(specs)

    async def run() -> None:
        async for index, payload, finished in engine.generate(specs, stream=False):
            if finished:
                results[index] = payload

    runner = asyncio.create_task(run())
    watcher = asyncio.create_task(watch_disconnect(request))
    try:
        await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not runner.done():
            runner.cancel()
    if runner.cancelled() or not runner.done():
        raise ConnectionAbortedError("client disconnected")
    runner.result()
    return results


def create_app(settings: ReferenceEngineSettings, engine: ReferenceEngine | None = None) -> FastAPI:
    """The FastAPI app; the model is loaded during startup, before the port opens."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = engine or ReferenceEngine(settings)
        app.state.engine.start()
        log.info(
            "reference engine ready: %s (%s) in %.2fs",
            app.state.engine.model_path,
            app.state.engine.precision,
            app.state.engine.startup_seconds,
        )
        yield
        app.state.engine.stop()

    app = FastAPI(title="Tether CPU reference engine (SGLang HTTP subset)", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        body = {"object": "error", "message": str(exc.errors()), "type": "Bad Request"}
        return JSONResponse({**body, "param": None, "code": 400}, status_code=400)

    def eng(request: Request) -> ReferenceEngine:
        return request.app.state.engine

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        engine = eng(request)
        try:
            body = await request.json()
            specs, batch = build_specs(engine, body)
        except SamplingParamsError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except (ValueError, TypeError, json.JSONDecodeError) as exc:
            return generate_error(str(exc))
        if body.get("stream"):
            return StreamingResponse(
                stream_generate(engine, specs, batch), media_type="text/event-stream"
            )
        try:
            results = await collect(engine, specs, request)
        except DuplicateRequest as exc:
            return generate_error(str(exc))
        except ConnectionAbortedError:
            return Response(status_code=499)
        if body.get("return_prompt_token_ids"):
            for spec, result in zip(specs, results, strict=True):
                result["prompt_token_ids"] = spec.input_ids
        return JSONResponse(results if batch else results[0])

    async def stream_generate(engine, specs, batch) -> AsyncIterator[bytes]:
        try:
            async for index, payload, _finished in engine.generate(specs, stream=True):
                yield sse({**payload, "index": index} if batch else payload)
        except DuplicateRequest as exc:
            error = {"message": str(exc), "type": "invalid_request_error", "code": 400}
            yield sse({"error": {**error, "retryable": False}})
        yield b"data: [DONE]\n\n"

    @app.post("/pause_generation")
    async def pause_generation(request: Request, body: PauseBody | None = None) -> dict:
        await eng(request).pause((body or PauseBody()).mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request, body: ContinueBody | None = None) -> dict:
        await eng(request).resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request, body: UpdateFromDiskBody) -> JSONResponse:
        outcome = await eng(request).update_weights_from_disk(
            body.model_path, body.weight_version, body.flush_cache, body.abort_all_requests
        )
        return JSONResponse(outcome.body(), status_code=200 if outcome.success else 400)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request, body: UpdateWeightVersionBody) -> dict:
        await eng(request).update_weight_version(body.new_version, body.abort_all_requests)
        message = f"Weight version updated to {body.new_version}"
        return {"success": True, "message": message, "new_version": body.new_version}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> PlainTextResponse:
        if eng(request).flush_cache():
            return PlainTextResponse(FLUSH_OK)
        return PlainTextResponse("Flush cache failed.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request, body: AbortBody) -> Response:
        await eng(request).abort(body.rid, body.abort_all)
        return Response(status_code=200)

    async def health_response(request: Request, generation: bool) -> Response:
        engine = eng(request)
        if not generation:
            return Response(status_code=200 if engine.scheduler.alive else 503)
        return Response(status_code=200 if await engine.health_probe() else 503)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await health_response(request, eng(request).settings.health_generate)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        return await health_response(request, True)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        engine = eng(request)
        up = engine.scheduler.alive and not engine.gate.paused
        return Response(status_code=200 if up else 503)

    def model_info(engine: ReferenceEngine) -> dict:
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.scheduler.label,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": engine.config.get("model_type"),
            "architectures": engine.config.get("architectures"),
            "precision": engine.precision,
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict:
        return model_info(eng(request))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request) -> dict:
        engine = eng(request)
        last = engine.last_update
        return {
            **engine.settings.model_dump(mode="json"),
            "version": ENGINE_VERSION,
            "frontend": "python",
            "startup_time": engine.started_at,
            "startup_seconds": engine.startup_seconds,
            "internal_states": [
                {
                    **engine.scheduler.load(),
                    "paused": engine.gate.paused,
                    "in_flight": engine.gate.in_flight,
                    "scheduler_weight_version": engine.scheduler.scheduler_version,
                    "last_update": None if last is None else last.body(),
                }
            ],
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        engine = eng(request)
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "created": int(engine.started_at),
        }
        return {
            "object": "list",
            "data": [{**card, "owned_by": "tether", "root": engine.model_path}],
        }

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request, body: WeightsByNameBody) -> Response:
        params = dict(eng(request).scheduler.model.named_parameters())
        if body.name not in params:
            return generate_error(f"no parameter named {body.name!r}")
        return JSONResponse(params[body.name].detach()[: body.truncate_size].tolist())

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request, body: WeightsCheckerBody | None = None) -> Response:
        action = (body or WeightsCheckerBody()).action
        if action != "checksum":
            message = f"action {action!r} is not supported by the reference engine; use checksum"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        checksum = eng(request).served_checksum()
        return JSONResponse(
            {"success": True, "message": checksum, "per_engine_checksum": [checksum]}
        )

    from reference_engine.openai_routes import router as openai_router

    app.include_router(openai_router)
    return app
