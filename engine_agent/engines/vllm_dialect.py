"""`VLLMDialect`: the agent's rollout contract over vLLM's routes.

Owns the translation both ways, so a client sees the same answer from a vLLM engine as from
an SGLang or reference engine:

- `/generate` (SGLang's native shape: `input_ids` or `text`, `sampling_params`,
  `return_logprob`, `logprob_start_len`, `rid`, `extra_key`, `stream`) becomes vLLM's
  token route `/inference/v1/generate` (`--enable-scale-out`): token ids in (text is
  tokenized first with vLLM's `/tokenize`), token ids, per-token logprobs and vLLM's
  per-token `weight_versions` spans out, rebuilt as SGLang's `{text, output_ids,
  meta_info}`. Streams are re-emitted cumulative, as SGLang's are.
- `/v1/completions` and `/v1/chat/completions` pass through; `rid` becomes vLLM's
  `request_id`.
- The prefix-cache namespace (`extra_key` on SGLang) is vLLM's `cache_salt`.
- A client that leaves is aborted with `/abort_requests` and vLLM's prefixed request ids.

Must never change weights or decide versions; it only reshapes bodies.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from engine_agent.engines.base import Dialect, EngineRequest, UnsupportedRequest, namespace_key

log = logging.getLogger(__name__)

TOKEN_ROUTE = "/inference/v1/generate"
# vLLM prefixes the request id it is given with the route's own prefix.
_ID_PREFIX = {
    "/generate": "generate-tokens-",
    "/v1/completions": "cmpl-",
    "/v1/chat/completions": "chatcmpl-",
}
# SGLang sampling parameter → vLLM's name for it (same meaning).
_SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "sampling_seed": "seed",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "logit_bias": "logit_bias",
}
# SGLang's default when `max_new_tokens` is absent (vLLM's would be the context length).
_DEFAULT_MAX_NEW_TOKENS = 128
# SGLang's "all tokens" top_k (1 << 30) is -1 on vLLM.
_TOP_K_ALL = 1 << 30
_UNSUPPORTED = ("input_embeds", "top_logprobs_num", "token_ids_logprob", "lora_path")


def sampling_params(given: dict[str, Any]) -> dict[str, Any]:
    """SGLang `sampling_params` as vLLM's; unknown names are refused, naming the field."""
    out: dict[str, Any] = {"max_tokens": _DEFAULT_MAX_NEW_TOKENS}
    for name, value in given.items():
        if name == "n" and value not in (None, 1):
            raise UnsupportedRequest(
                "body.sampling_params.n: a vLLM engine serves n=1 on /generate; send one "
                "request per sample"
            )
        if name == "n" or value is None:
            continue
        if name not in _SAMPLING_NAMES:
            raise UnsupportedRequest(
                f"body.sampling_params.{name}: not supported on a vLLM engine; supported: "
                f"{', '.join(sorted(_SAMPLING_NAMES))}"
            )
        if name == "top_k" and value >= _TOP_K_ALL:
            value = -1
        out[_SAMPLING_NAMES[name]] = value
    return out


def _finish_reason(choice: dict[str, Any], completion_tokens: int) -> dict[str, Any] | None:
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "abort":
        return {"type": "abort", "message": "Aborted"}
    return {"type": "stop", "matched": choice.get("stop_reason")}


def _prompt_logprobs(
    prompt: list[int], entries: list[Any] | None, start: int
) -> list[list[Any]] | None:
    """vLLM's prompt logprobs (per position, `{token_id: {logprob, ...}}` or null) as
    SGLang's `[logprob, token_id, null]` triples from position `start`."""
    if entries is None:
        return None
    triples = []
    for position, token in enumerate(prompt):
        entry = entries[position] if position < len(entries) else None
        found = (entry or {}).get(str(token)) or (entry or {}).get(token)
        triples.append([found["logprob"] if found else None, token, None])
    return triples[start:]


class _Answer:
    """One answer accumulated across stream chunks (or built from one JSON reply)."""

    def __init__(self, call: EngineRequest) -> None:
        self.call = call
        self.text = ""
        self.output_ids: list[int] = []
        self.logprobs: list[list[Any]] = []

    def add(self, choice: dict[str, Any]) -> None:
        ids = list(choice.get("token_ids") or [])
        self.text += choice.get("text") or ""
        content = (choice.get("logprobs") or {}).get("content") or []
        for token, entry in zip(ids, content, strict=False):
            self.logprobs.append([entry.get("logprob"), token, None])
        self.output_ids += ids

    def sglang(self, payload: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        context = self.call.context
        prompt: list[int] = context["prompt"]
        meta: dict[str, Any] = {
            "id": context["rid"],
            "finish_reason": _finish_reason(choice, len(self.output_ids)),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": ((payload.get("usage") or {}).get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            ),
        }
        spans = choice.get("weight_versions")
        if spans:
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if context["return_logprob"]:
            meta["output_token_logprobs"] = list(self.logprobs)
            start = context["logprob_start_len"]
            if start >= 0:
                meta["input_token_logprobs"] = _prompt_logprobs(
                    prompt, payload.get("prompt_logprobs"), start
                )
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class VLLMDialect(Dialect):
    """Rollout requests in the agent's contract, served by vLLM."""

    async def request(
        self, path: str, body: dict[str, Any], version: int, client: httpx.AsyncClient
    ) -> EngineRequest:
        key = namespace_key(version, body.pop("extra_key", None) or body.pop("cache_salt", None))
        rid = str(body.pop("rid", None) or f"tether-{uuid.uuid4().hex}")
        if path != "/generate":
            body["cache_salt"] = key
            body["request_id"] = rid
            return EngineRequest(path, body, [_ID_PREFIX[path] + rid])
        for name in _UNSUPPORTED:
            if body.get(name):
                raise UnsupportedRequest(f"body.{name}: not supported on a vLLM engine")
        prompt = body.get("input_ids")
        if prompt is None:
            text = body.get("text")
            if not isinstance(text, str):
                raise UnsupportedRequest(
                    "body.text / body.input_ids: a vLLM engine takes one prompt per request "
                    "(a string or a list of token ids); send batches as separate requests"
                )
            reply = await client.post(
                "/tokenize", json={"prompt": text, "add_special_tokens": True}, timeout=30.0
            )
            reply.raise_for_status()
            prompt = reply.json()["tokens"]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise UnsupportedRequest(
                "body.input_ids: expected one non-empty list of token ids; send batches as "
                "separate requests"
            )
        params = sampling_params(dict(body.get("sampling_params") or {}))
        return_logprob = bool(body.get("return_logprob"))
        start = body.get("logprob_start_len")
        start = -1 if start is None else int(start)
        if return_logprob:
            params["logprobs"] = 0
            if start >= 0:
                params["prompt_logprobs"] = 0
        engine_body = {
            "request_id": rid,
            "token_ids": prompt,
            "sampling_params": params,
            "output_mode": "text",
            "cache_salt": key,
            "stream": bool(body.get("stream")),
        }
        context = {
            "prompt": prompt,
            "rid": rid,
            "return_logprob": return_logprob,
            "logprob_start_len": start,
        }
        return EngineRequest(TOKEN_ROUTE, engine_body, [_ID_PREFIX[path] + rid], context)

    def reply(self, call: EngineRequest, payload: Any) -> Any:
        if call.path != TOKEN_ROUTE or not isinstance(payload, dict):
            return payload
        choice = (payload.get("choices") or [{}])[0]
        answer = _Answer(call)
        answer.add(choice)
        return answer.sglang(payload, choice)

    def stream(self, call: EngineRequest) -> Callable[[Any], Any]:
        if call.path != TOKEN_ROUTE:
            return lambda payload: payload
        answer = _Answer(call)

        def translate(payload: Any) -> Any:
            if not isinstance(payload, dict) or "choices" not in payload:
                return payload  # an error chunk passes as it is
            choices = payload.get("choices") or []
            if not choices:
                return None  # a usage-only chunk
            answer.add(choices[0])
            return answer.sglang(payload, choices[0])

        return translate

    async def abort(self, client: httpx.AsyncClient, rids: list[str]) -> None:
        # vLLM aborts a request whose client went away by itself; this covers a proxy
        # connection the engine has not noticed closing yet.
        try:
            await client.post("/abort_requests", json={"request_ids": rids}, timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning("could not abort %s at the engine: %s", rids, exc)
