"""The reference engine's generation routes answer with SGLang's shapes (real process)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.reference_engine import ReferenceEngineProcess

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def generate(engine: ReferenceEngineProcess, body: dict) -> dict:
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_from_text_has_sglang_fields_and_one_span(bf16_engine):
    out = generate(bf16_engine, {"text": "3+5=", "sampling_params": GREEDY, "rid": "shape-1"})
    meta = out["meta_info"]
    assert set(out) >= {"text", "output_ids", "meta_info"}
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6 == len(out["output_ids"])
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]


def test_input_ids_and_text_give_the_same_greedy_output(bf16_engine):
    by_text = generate(bf16_engine, {"text": "3+5=", "sampling_params": GREEDY})
    ids = httpx.post(
        f"{bf16_engine.url}/generate",
        json={"text": "3+5=", "sampling_params": {**GREEDY, "max_new_tokens": 0}},
    ).json()
    assert ids["output_ids"] == []
    from transformers import AutoTokenizer

    info = httpx.get(f"{bf16_engine.url}/model_info").json()
    prompt = AutoTokenizer.from_pretrained(info["tokenizer_path"])("3+5=").input_ids
    by_ids = generate(
        bf16_engine,
        {"input_ids": prompt, "sampling_params": GREEDY, "return_prompt_token_ids": True},
    )
    assert by_ids["prompt_token_ids"] == prompt
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]


def test_logprobs_are_one_triple_per_output_token_with_top_k(bf16_engine):
    out = generate(
        bf16_engine,
        {
            "text": "1+2=",
            "sampling_params": GREEDY,
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    )
    meta = out["meta_info"]
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(t[2] is None and t[0] <= 0.0 for t in triples)
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(triples)
    for chosen, top in zip(triples, tops, strict=True):
        assert len(top) == 3
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        # greedy: the chosen token is the most likely one
        assert top[0][1] == chosen[1] and top[0][0] == pytest.approx(chosen[0])


def test_prompt_logprobs_start_with_null_when_logprob_start_len_is_zero(bf16_engine):
    out = generate(
        bf16_engine,
        {
            "text": "1+2=",
            "sampling_params": GREEDY,
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    prompt = out["meta_info"]["input_token_logprobs"]
    assert len(prompt) == 4 and prompt[0][0] is None
    assert all(p[0] < 0 for p in prompt[1:])


def test_a_fixed_sampling_seed_reproduces_the_sample_and_another_seed_differs(bf16_engine):
    def sample(seed: int) -> list[int]:
        params = {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": seed}
        return generate(bf16_engine, {"text": "7+8=", "sampling_params": params})["output_ids"]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_stream_chunks_are_cumulative_and_end_with_done(bf16_engine):
    body = {"text": "3+5=", "sampling_params": {**GREEDY, "max_new_tokens": 4}, "stream": True}
    with httpx.stream("POST", f"{bf16_engine.url}/generate", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "weight_versions" not in chunks[0]["meta_info"]
    assert chunks[-1]["meta_info"]["weight_versions"] == [
        {"version": "default", "start": 0, "end": 4}
    ]


def test_batch_of_texts_returns_an_array_in_input_order(bf16_engine):
    single = [generate(bf16_engine, {"text": t, "sampling_params": GREEDY}) for t in ("1+1=", "9")]
    batch = generate(bf16_engine, {"text": ["1+1=", "9"], "sampling_params": GREEDY, "rid": "b"})
    assert isinstance(batch, list)
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in single]
    assert [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1"]


def test_unknown_sampling_param_is_refused_like_sglang_0_5_22(bf16_engine):
    for key in ("max_tokens", "seed"):
        response = httpx.post(
            f"{bf16_engine.url}/generate",
            json={"text": "1", "sampling_params": {key: 3}},
        )
        assert response.status_code == 400
        assert response.json()["error"].startswith(f"unknown field `{key}`")


def test_bad_prompts_are_a_400_with_an_error_message(bf16_engine):
    response = httpx.post(f"{bf16_engine.url}/generate", json={"text": "1", "input_ids": [1]})
    assert response.status_code == 400
    assert "text or input_ids" in response.json()["error"]["message"]
    for ids in ([], [10**6], [-1]):
        response = httpx.post(f"{bf16_engine.url}/generate", json={"input_ids": ids})
        assert response.status_code == 400, ids
        assert response.json()["error"]["message"]


def test_stop_string_ends_generation_and_is_trimmed(bf16_engine):
    full = generate(
        bf16_engine, {"text": "2+2=", "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    )
    stop = full["text"][-1]
    cut = generate(
        bf16_engine,
        {"text": "2+2=", "sampling_params": {**GREEDY, "max_new_tokens": 8, "stop": [stop]}},
    )
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == full["text"][: full["text"].index(stop)]


def test_concurrent_requests_all_finish_with_their_sequential_outputs(bf16_engine):
    prompts = [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 9), (0, 1)]]
    sequential = [generate(bf16_engine, {"text": p, "sampling_params": GREEDY}) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        parallel = list(
            pool.map(
                lambda p: generate(bf16_engine, {"text": p, "sampling_params": GREEDY}), prompts
            )
        )
    assert [p["output_ids"] for p in parallel] == [s["output_ids"] for s in sequential]


def test_duplicate_rid_in_flight_is_refused_and_abort_request_returns_partial_output(bf16_engine):
    long = {"text": "1", "rid": "dup-abc", "sampling_params": {**GREEDY, "max_new_tokens": 5000}}
    body = {**long, "stream": True}
    with httpx.stream("POST", f"{bf16_engine.url}/generate", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first.removeprefix("data: "))["meta_info"]["finish_reason"] is None
        duplicate = httpx.post(f"{bf16_engine.url}/generate", json=long, timeout=10)
        assert duplicate.status_code == 400
        assert "Duplicate request ID" in duplicate.json()["error"]["message"]
        # prefix match, as SGLang: "dup" aborts "dup-abc"
        aborted = httpx.post(f"{bf16_engine.url}/abort_request", json={"rid": "dup"})
        assert aborted.status_code == 200 and aborted.content == b""
        rest = [json.loads(x.removeprefix("data: ")) for x in lines if x and x != "data: [DONE]"]
    final = rest[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    assert final["finish_reason"]["message"] == "Aborted"
    assert 0 < final["completion_tokens"] < 5000


def test_openai_completions_and_chat_carry_the_weight_version_metadata(bf16_engine):
    completion = httpx.post(
        f"{bf16_engine.url}/v1/completions",
        json={"prompt": "3+5=", "max_tokens": 3, "temperature": 0, "logprobs": 2},
    ).json()
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["finish_reason"] == "length"
    assert len(completion["choices"][0]["logprobs"]["token_logprobs"]) == 3
    assert completion["usage"]["completion_tokens"] == 3
    assert completion["metadata"]["weight_versions"] == [
        {"version": "default", "start": 0, "end": 3}
    ]
    chat = httpx.post(
        f"{bf16_engine.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "3+5="}],
            "max_tokens": 2,
            "temperature": 0,
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 1,
        },
    ).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert len(chat["choices"][0]["logprobs"]["content"]) == 2
    assert chat["usage"]["prompt_tokens"] > 4  # the chat template wrapped the message
    assert chat["metadata"]["weight_version"] == "default"


def test_openai_stream_sends_deltas_then_done(bf16_engine):
    body = {"prompt": "3+5=", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{bf16_engine.url}/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = httpx.post(
        f"{bf16_engine.url}/v1/completions",
        json={"prompt": "3+5=", "max_tokens": 3, "temperature": 0},
    ).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_info_health_and_flush_routes_answer_as_sglang(bf16_engine):
    with bf16_engine.client() as client:
        info = client.get("/model_info").json()
        assert info["weight_version"] == "default" and info["model_type"] == "qwen3"
        assert client.get("/get_weight_version").status_code == 404
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200
        assert client.get("/ready").status_code == 200
        flushed = client.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        assert client.get("/server_info").json()["version"].startswith("tether-reference")
        assert client.get("/v1/models").json()["data"][0]["id"] == info["served_model_name"]
        missing = client.post("/update_weights_from_disk", json={})
        assert missing.status_code == 400 and missing.json()["object"] == "error"
