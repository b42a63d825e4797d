"""An engine agent driving a real vLLM server (the CPU build from `.venv-vllm`), in a
mixed fleet beside reference engines in FP8 and NVFP4.

One fleet serves the whole module (the vLLM start is the expensive part): a control plane,
a folder store, the vLLM engine (BF16) and two reference engines, an agent beside each.
Every test starts from whatever version the fleet is on and publishes what it needs. The
weights really change: after each commit vLLM's prompt logprobs equal those transformers
computes for the same version, and differ from the previous version's.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine_agent.conftest import (
    ControlPlaneProcess,
    VersionChain,
    generate,
    launch_agent,
    server_info,
    wait_agent,
    wait_applied,
)
from tests.fixtures.processes import ManagedProcess, stop_all, wait_until
from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    launch_reference_engine,
    wait_until_ready,
)
from tests.fixtures.vllm_engine import start_vllm_engine

RUN = "vllm-run"
CATCH_UP_S = 180.0
PROMPT = [5, 17, 3, 42, 9, 11, 60, 2]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
# vLLM and transformers both compute in bfloat16: they agree within ~0.004 on the tiny
# model, while one published version moves these logprobs by 0.06 or more.
BF16_ATOL = 0.03


@dataclass
class VLLMSetup:
    root: Path
    chain: VersionChain
    cp: ControlPlaneProcess
    engine: ManagedProcess
    agent: ManagedProcess
    others: dict[str, ManagedProcess]

    @property
    def url(self) -> str:
        return self.agent.url or ""

    def publish(self, kind: str) -> int:
        version = self.chain.publish(kind)
        self.cp.notify(RUN, version)
        return version


@pytest.fixture(scope="module")
def vllm(tiny: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMSetup]:
    from tests.engine_agent.conftest import start_controlplane

    root = tmp_path_factory.mktemp("vllm")
    cp = start_controlplane(root)
    chain = VersionChain(root / "store", RUN, tiny.bf16)
    reply = cp.call("POST", "/v1/runs", "trainer", json={"run_id": RUN})
    assert reply.status_code == 201, reply.text
    cp.notify(RUN, 0)
    boots = {"fp8": tiny.fp8, "nvfp4": tiny.nvfp4}
    started: list[ManagedProcess] = [cp.process]
    try:
        references = {
            p: launch_reference_engine(b, root / f"engine-{p}.log") for p, b in boots.items()
        }
        started += references.values()
        engine = start_vllm_engine(tiny.bf16, root / "vllm.log", "--", "--enable-log-requests")
        started.append(engine)
        agent = launch_agent(
            "agent-vllm", engine.url or "", "bf16", root, store_root=chain.store_root,
            run_id=RUN, boot_model=tiny.bf16, control_plane=cp,
            extra=("--engine-kind", "vllm"),
        )  # fmt: skip
        started.append(agent)
        others = {}
        for precision, reference in references.items():
            wait_until_ready(reference)
            others[precision] = launch_agent(
                f"agent-{precision}", reference.url or "", precision, root,
                store_root=chain.store_root, run_id=RUN, boot_model=boots[precision],
                control_plane=cp,
            )  # fmt: skip
            started.append(others[precision])
        for each in (agent, *others.values()):
            wait_agent(each)
            wait_applied(each, 0, CATCH_UP_S)
        yield VLLMSetup(root, chain, cp, engine, agent, others)
    finally:
        stop_all(reversed(started))


def transformers_prompt_logprobs(chain: VersionChain, version: int) -> list[float]:
    """log p(PROMPT[i] | PROMPT[:i]) for i ≥ 1 under `version`, computed by transformers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = json.loads((chain.boot / "config.json").read_text())
    model = Qwen3ForCausalLM(
        Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"})
    )
    model.load_state_dict(chain.torch_tensors(version), strict=False)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]


def engine_prompt_logprobs(url: str) -> tuple[list[float], dict]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = generate(url, body)
    assert reply.status_code == 200, reply.text
    triples = reply.json()["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in triples] == PROMPT
    assert triples[0][0] is None  # the first prompt token has no context
    return [t[0] for t in triples[1:]], reply.json()


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_agent_reports_the_engine_kind_and_labels_the_engine(vllm: VLLMSetup) -> None:
    info = server_info(vllm.agent)
    assert info["engine_kind"] == "vllm"
    label = httpx.get(f"{vllm.engine.url}/weight_info", timeout=10).json()["weight_version"]
    assert label == str(info["applied_version"])


def test_token_ids_in_token_ids_and_logprobs_out_with_the_version_span(vllm: VLLMSetup) -> None:
    served = server_info(vllm.agent)["applied_version"]
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    reply = generate(vllm.url, body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    meta = answer["meta_info"]
    assert len(answer["output_ids"]) == meta["completion_tokens"] == 6
    assert [t[1] for t in meta["output_token_logprobs"]] == answer["output_ids"]
    assert all(t[0] <= 0 for t in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert answer["weight_version_start"] == answer["weight_version_end"] == served
    assert meta["weight_versions"] == [{"version": str(served), "start": 0, "end": 6}]
    assert reply.headers["X-Tether-Weight-Version-End"] == str(served)

    # Text in gives the same tokens for the same prompt; greedy output is deterministic.
    text = generate(vllm.url, {"text": "1 + 2 =", "sampling_params": GREEDY}).json()
    again = generate(vllm.url, {"text": "1 + 2 =", "sampling_params": GREEDY}).json()
    assert text["output_ids"] == again["output_ids"] and isinstance(text["text"], str)


def test_streaming_is_cumulative_and_ends_with_the_version_span(vllm: VLLMSetup) -> None:
    served = server_info(vllm.agent)["applied_version"]
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{vllm.url}/generate", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    # vLLM merges the steps a slow reader has not taken yet, so a busy machine may see one
    # chunk; whatever their number, each one holds everything generated so far.
    last = chunks[-1]
    assert len(last["output_ids"]) == 6
    for chunk in chunks:
        assert last["output_ids"][: len(chunk["output_ids"])] == chunk["output_ids"]
        assert last["text"].startswith(chunk["text"])
    assert last["meta_info"]["finish_reason"] is not None
    assert last["weight_version_start"] == last["weight_version_end"] == served
    whole = generate(vllm.url, {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert last["output_ids"] == whole["output_ids"]


def test_unsupported_fields_get_a_400_naming_the_field(vllm: VLLMSetup) -> None:
    reply = generate(vllm.url, {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY})
    assert reply.status_code == 400 and "body.input_ids" in reply.json()["error"]["message"]
    bad = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "json_schema": "{}"}}
    reply = generate(vllm.url, bad)
    assert reply.status_code == 400
    assert "sampling_params.json_schema" in reply.json()["error"]["message"]


def test_catch_up_across_full_xor_and_sparse_versions_really_changes_the_weights(
    vllm: VLLMSetup,
) -> None:
    previous = server_info(vllm.agent)["applied_version"]
    before, _ = engine_prompt_logprobs(vllm.url)
    for kind in ("full", "xor", "sparse"):
        version = vllm.publish(kind)
        info = wait_applied(vllm.agent, version, CATCH_UP_S)
        assert info["last_pass"]["outcome"] == "committed"
        after, answer = engine_prompt_logprobs(vllm.url)
        assert answer["weight_version_start"] == answer["weight_version_end"] == version
        expected = transformers_prompt_logprobs(vllm.chain, version)
        assert max_gap(after, expected) < BF16_ATOL, (kind, after, expected)
        old = transformers_prompt_logprobs(vllm.chain, previous)
        # The update moved the logprobs, and vLLM follows the new version, not the old one.
        assert max_gap(after, before) > BF16_ATOL, kind
        assert max_gap(after, expected) < max_gap(after, old), kind
        previous, before = version, after


def test_exact_pin_gets_409_then_succeeds(vllm: VLLMSetup) -> None:
    future = vllm.chain.latest + 1
    body = {
        "input_ids": PROMPT,
        "sampling_params": GREEDY,
        "weight_version": {"exact_version": future},
    }
    early = generate(vllm.url, body)
    assert early.status_code == 409, early.text
    assert early.json()["error"]["type"] == "WeightVersionNotReady"
    assert vllm.publish("sparse") == future

    def served() -> dict | None:
        reply = generate(vllm.url, body)
        return reply.json() if reply.status_code == 200 else None

    answer = wait_until(served, CATCH_UP_S, f"a request pinned to v{future} to be served")
    assert answer["weight_version_start"] == answer["weight_version_end"] == future


def test_a_commit_under_load_loses_no_request(vllm: VLLMSetup) -> None:
    start = server_info(vllm.agent)["applied_version"]
    stop = threading.Event()
    results: list[tuple[int, dict]] = []

    def client() -> None:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24}}
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                reply = http.post(f"{vllm.url}/generate", json=body)
                results.append((reply.status_code, reply.json()))

    threads = [threading.Thread(target=client) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(results) >= 3, CATCH_UP_S, "load to reach the engine")
        target = vllm.publish("sparse")
        wait_applied(vllm.agent, target, CATCH_UP_S)
        seen = len(results)
        wait_until(lambda: len(results) >= seen + 3, CATCH_UP_S, "requests after the commit")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200]
    for _, answer in results:
        assert len(answer["output_ids"]) == answer["meta_info"]["completion_tokens"] > 0
        assert start <= answer["weight_version_start"] <= answer["weight_version_end"] <= target
    assert any(answer["weight_version_end"] == target for _, answer in results)


def test_a_client_that_leaves_aborts_its_engine_request(vllm: VLLMSetup) -> None:
    rid = f"leaves-{uuid.uuid4().hex}"
    body = {
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", f"{vllm.url}/generate", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data:"):
                break  # the first chunk: the engine is generating; now leave
    # vLLM logs each abort (--enable-log-requests) with the request id it was given.
    wait_until(
        lambda: f"Aborted request(s) generate-tokens-{rid}" in vllm.engine.log_tail(200_000),
        60.0,
        "the engine to abort the request of the client that left",
    )
    # The engine is free: a new request is answered completely.
    reply = generate(vllm.url, {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 6


def test_the_router_knows_the_engine_kinds(vllm: VLLMSetup) -> None:
    kinds = {e["precision"]: e["engine_kind"] for e in vllm.cp.engines(RUN)}
    assert kinds == {"bf16": "vllm", "fp8": "sglang", "nvfp4": "sglang"}


def test_a_mixed_fleet_serves_version_pinned_rollouts_without_violations(
    vllm: VLLMSetup,
) -> None:
    target = vllm.publish("sparse")
    for each in (vllm.agent, *vllm.others.values()):
        wait_applied(each, target, CATCH_UP_S)
    headers = {"Authorization": f"Bearer {vllm.cp.tokens['client']}"}
    asks = []
    for precision in ("bf16", "fp8", "nvfp4"):
        asks.append((precision, {"exact_version": target}))
        asks.append((precision, {"min_version": target}))
        asks.append((precision, {"min_version": 0}))
    answered: dict[str, int] = {}
    with httpx.Client(base_url=vllm.cp.url, headers=headers, timeout=120) as client:
        for precision, constraint in asks:
            body = {
                "input_ids": PROMPT,
                "sampling_params": GREEDY,
                "return_logprob": True,
                "precision": precision,
                "weight_version": constraint,
            }
            reply = client.post("/v1/generate", json=body)
            assert reply.status_code == 200, (precision, constraint, reply.text)
            answer = reply.json()
            start, end = answer["weight_version_start"], answer["weight_version_end"]
            if "exact_version" in constraint:
                assert start == end == constraint["exact_version"], (precision, answer)
            else:
                assert start >= constraint["min_version"], (precision, answer)
            assert len(answer["meta_info"]["output_token_logprobs"]) == 6
            answered[precision] = answered.get(precision, 0) + 1
    assert answered == {"bf16": 3, "fp8": 3, "nvfp4": 3}


def test_an_agent_for_vllm_refuses_to_start_beside_another_engine_naming_the_fix(
    bf16_engine: ReferenceEngineProcess, tiny: TinyCheckpoints, tmp_path: Path
) -> None:
    chain = VersionChain(tmp_path / "store", RUN, tiny.bf16)
    agent = launch_agent(
        "agent-wrong-kind", bf16_engine.url or "", "bf16", tmp_path,
        store_root=chain.store_root, run_id=RUN, boot_model=tiny.bf16,
        extra=("--engine-kind", "vllm"),
    )  # fmt: skip
    try:
        code = agent.process.wait(timeout=120)
    finally:
        stop_all([agent])
    assert code == 1
    assert "is not a vLLM server" in agent.log_tail() and "--engine-kind" in agent.log_tail()


@pytest.mark.parametrize("mode", ["in_place", "quiesce"])
def test_each_pause_mode_pauses_vllm_and_resume_lets_it_serve_again(
    vllm: VLLMSetup, mode: str
) -> None:
    import asyncio

    from engine_agent.engines.base import PauseMode
    from engine_agent.engines.vllm import VLLMEngine

    engine_url = vllm.engine.url or ""

    def paused() -> bool:
        return httpx.get(f"{engine_url}/is_paused", timeout=10).json()["is_paused"]

    async def pause_then_resume() -> tuple[bool, bool]:
        engine = VLLMEngine(engine_url)
        try:
            await engine.pause(PauseMode(mode))
            during = await asyncio.to_thread(paused)
            await engine.resume()
            return during, await asyncio.to_thread(paused)
        finally:
            await engine.close()

    assert asyncio.run(pause_then_resume()) == (True, False)
    reply = generate(vllm.url, {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 6
