"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions` as SGLang serves them.

Owns the translation of OpenAI bodies (`max_tokens`, `seed` → `sampling_seed`, `logprobs`,
SGLang's extras `top_k`, `min_p`, `rid`, `extra_key`, ...) into native specs, the chat
template from the tokenizer, and the response shapes, including the non-stream top-level
`metadata: {"weight_version", "weight_versions"}` taken from choice 0. Stream chunks carry
no metadata, as in SGLang. Must never run the model directly.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from reference_engine.engine import ReferenceEngine, RequestSpec
from reference_engine.sampling import SamplingParamsError, parse_sampling_params

router = APIRouter()

_EXTRAS = ("top_k", "min_p", "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens")


def _error(message: str, status: int = 400) -> JSONResponse:
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None}
    return JSONResponse({**body, "code": status}, status_code=status)


def _sampling(body: dict, default_max: int | None) -> dict:
    params: dict[str, Any] = {
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "n": body.get("n", 1),
        "stop": body.get("stop"),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "sampling_seed": body.get("seed"),
        "logit_bias": body.get("logit_bias"),
    }
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    for key in _EXTRAS:
        if key in body:
            params[key] = body[key]
    return params


def _specs(prompts: list[list[int]], body: dict, params: dict, top: int, logprob: bool) -> list:
    parsed = parse_sampling_params(params)
    copies = parsed.n
    base = body.get("rid") or uuid.uuid4().hex
    total = len(prompts) * copies
    return [
        RequestSpec(
            input_ids=prompts[i // copies],
            params=parsed,
            rid=base if total == 1 else f"{base}_{i}",
            return_logprob=logprob,
            top_logprobs_num=top,
            return_text_in_logprobs=True,
            extra_key=body.get("extra_key") or None,
        )
        for i in range(total)
    ]


def _finish(meta: dict) -> tuple[str | None, Any]:
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


def _usage(payloads: list[dict]) -> dict:
    prompt = sum(p["meta_info"]["prompt_tokens"] for p in payloads[:1])
    completion = sum(p["meta_info"]["completion_tokens"] for p in payloads)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "reasoning_tokens": 0,
    }


def _metadata(payload: dict) -> dict:
    meta = payload["meta_info"]
    return {
        "weight_version": meta["weight_version"],
        "weight_versions": meta.get("weight_versions"),
    }


def _completion_logprobs(meta: dict) -> dict | None:
    if "output_token_logprobs" not in meta:
        return None
    tokens = [t[2] for t in meta["output_token_logprobs"]]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token or "")
    return {
        "tokens": tokens,
        "token_logprobs": [t[0] for t in meta["output_token_logprobs"]],
        "top_logprobs": [{t[2]: t[0] for t in top} for top in meta.get("output_top_logprobs", [])],
        "text_offset": offsets,
    }


def _chat_logprobs(meta: dict) -> dict | None:
    if "output_token_logprobs" not in meta:
        return None
    tops = meta.get("output_top_logprobs") or [[] for _ in meta["output_token_logprobs"]]

    def entry(lp: float, text: str) -> dict:
        return {"token": text, "bytes": list(text.encode()), "logprob": lp}

    return {
        "content": [
            {**entry(lp, text), "top_logprobs": [entry(t[0], t[2]) for t in top]}
            for (lp, _tid, text), top in zip(meta["output_token_logprobs"], tops, strict=True)
        ]
    }


async def _collect(engine: ReferenceEngine, specs: list[RequestSpec]) -> list[dict]:
    results: list[dict] = [{} for _ in specs]
    async for index, payload, finished in engine.generate(specs, stream=False):
        if finished:
            results[index] = payload
    return results


async def _stream(engine: ReferenceEngine, specs: list[RequestSpec], chunk) -> AsyncIterator[bytes]:
    sent = [""] * len(specs)
    async for index, payload, _finished in engine.generate(specs, stream=True):
        delta = payload["text"][len(sent[index]) :]
        sent[index] = payload["text"]
        finish, matched = _finish(payload["meta_info"])
        yield b"data: " + json.dumps(chunk(index, delta, finish, matched)).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def _completion_choice(index: int, payload: dict, _body: dict) -> dict:
    finish, matched = _finish(payload["meta_info"])
    return {
        "index": index,
        "text": payload["text"],
        "logprobs": _completion_logprobs(payload["meta_info"]),
        "finish_reason": finish,
        "matched_stop": matched,
    }


def _chat_choice(index: int, payload: dict, body: dict) -> dict:
    finish, matched = _finish(payload["meta_info"])
    choice = {
        "index": index,
        "message": {"role": "assistant", "content": payload["text"], "tool_calls": None},
        "logprobs": _chat_logprobs(payload["meta_info"]),
        "finish_reason": finish,
        "matched_stop": matched,
    }
    if body.get("return_meta_info"):
        choice["meta_info"] = payload["meta_info"]
    if body.get("return_token_ids"):
        choice["response_token_ids"] = payload["output_ids"]
    return choice


async def _respond(
    engine: ReferenceEngine, specs: list[RequestSpec], body: dict, chat: bool
) -> Response:
    """Run the specs and answer as an OpenAI completion or chat completion (or its stream)."""
    envelope = {
        "id": specs[0].rid,
        "created": int(time.time()),
        "model": body.get("model") or engine.served_model_name,
    }
    if body.get("stream"):

        def chunk(index: int, delta: str, finish: str | None, matched: Any) -> dict:
            if chat:
                choice: dict = {"index": index, "delta": {"role": "assistant", "content": delta}}
            else:
                choice = {"index": index, "text": delta}
            choice.update(logprobs=None, finish_reason=finish, matched_stop=matched)
            kind = "chat.completion.chunk" if chat else "text_completion"
            return {**envelope, "object": kind, "choices": [choice]}

        return StreamingResponse(_stream(engine, specs, chunk), media_type="text/event-stream")
    payloads = await _collect(engine, specs)
    build = _chat_choice if chat else _completion_choice
    return JSONResponse(
        {
            **envelope,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [build(i, p, body) for i, p in enumerate(payloads)],
            "usage": _usage(payloads),
            "metadata": _metadata(payloads[0]),
        }
    )


async def _body(request: Request) -> dict:
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise ValueError("Unsupported Content-Type; expected application/json")
    return await request.json()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    engine: ReferenceEngine = request.app.state.engine
    try:
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [engine.encode(prompt)]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = [p if isinstance(p, list) else engine.encode(p) for p in prompt]
        else:
            raise ValueError("prompt must be a string, a list of strings or token ids")
        top = body.get("logprobs")
        specs = _specs(prompts, body, _sampling(body, 16), int(top or 0), top is not None)
    except (SamplingParamsError, ValueError, TypeError) as exc:
        return _error(str(exc))
    return await _respond(engine, specs, body, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    engine: ReferenceEngine = request.app.state.engine
    try:
        body = await _body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        prompt = engine.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=False,
            **(body.get("chat_template_kwargs") or {}),
        )
        ids = engine.encode(str(prompt))
        top = int(body.get("top_logprobs") or 0)
        specs = _specs([list(ids)], body, _sampling(body, None), top, bool(body.get("logprobs")))
        if body.get("stream") and body.get("return_meta_info"):
            raise ValueError("return_meta_info is not supported with streaming")
    except (SamplingParamsError, ValueError, TypeError) as exc:
        return _error(str(exc))
    return await _respond(engine, specs, body, chat=True)
