"""Pause, update and relabel on a real reference engine process, with SGLang's outcomes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from launcher.processes import wait_until
from reference_engine.engine import weights_checksum
from reference_engine.weights import dequantized_tensors
from tests.fixtures.reference_engine import ReferenceEngineProcess, start_reference_engine

# Long enough that the pause lands while it runs (the client sees the first token late on
# a busy machine), short enough to run to the end.
LONG = {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}
# Long enough (tens of seconds) that a loaded machine cannot finish it before the pause.
ENDLESS = {"temperature": 0.0, "max_new_tokens": 20_000, "ignore_eos": True}
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory) -> Iterator[ReferenceEngineProcess]:
    """A BF16 engine these tests pause and update; each test leaves it running."""
    process = start_reference_engine(tiny.bf16, tmp_path_factory.mktemp("logs") / "control.log")
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def always_resume(engine) -> Iterator[None]:
    yield
    httpx.post(f"{engine.url}/continue_generation", json={})


def post(engine: ReferenceEngineProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{engine.url}{path}", json=body, timeout=60)


def state(engine: ReferenceEngineProcess) -> dict:
    return httpx.get(f"{engine.url}/server_info").json()["internal_states"][0]


def running_one(engine: ReferenceEngineProcess) -> Callable[[], bool]:
    return lambda: state(engine)["num_running_reqs"] == 1


@contextmanager
def streaming(engine: ReferenceEngineProcess, body: dict) -> Iterator[Iterator[dict]]:
    """Open a streamed /generate and return once its first token has arrived."""
    with httpx.stream(
        "POST", f"{engine.url}/generate", json={**body, "stream": True}, timeout=60
    ) as response:
        chunks = (
            json.loads(line.removeprefix("data: "))
            for line in response.iter_lines()
            if line and line != "data: [DONE]"
        )
        first = next(chunks)
        assert first["meta_info"]["completion_tokens"] >= 1
        yield chunks


def last(chunks: Iterator[dict]) -> dict:
    *_, final = chunks
    return final


def greedy_ids(engine: ReferenceEngineProcess) -> list[int]:
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    return post(engine, "/generate", {"text": "4+4=", "sampling_params": params}).json()[
        "output_ids"
    ]


def test_pause_in_place_holds_the_request_and_tokens_after_the_update_carry_the_new_version(
    engine, tiny
):
    with streaming(engine, {"text": "1+1=", "sampling_params": LONG}) as chunks:
        assert post(engine, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
        held = state(engine)
        assert held["paused"] and held["num_running_reqs"] == 1
        assert httpx.get(f"{engine.url}/ready").status_code == 503
        update = post(
            engine,
            "/update_weights_from_disk",
            {"model_path": str(tiny.fp8), "weight_version": "v2", "flush_cache": False},
        ).json()
        assert update["success"], update
        assert update["num_paused_requests"] == 0 and update["load_seconds"] > 0
        # no token was produced while paused, across the whole update
        assert state(engine)["generated_tokens"] == held["generated_tokens"]
        assert post(engine, "/continue_generation", {}).status_code == 200
        final = last(chunks)["meta_info"]
    spans = final["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 1
    assert spans[1]["end"] == final["completion_tokens"] == LONG["max_new_tokens"]
    assert final["weight_version"] == "v2"
    assert final["num_retractions"] == 0
    post(engine, "/update_weights_from_disk", {"model_path": str(tiny.bf16), "weight_version": "1"})


def test_update_from_disk_switches_weights_and_bumps_the_version(engine, tiny):
    before = greedy_ids(engine)
    reply = post(
        engine,
        "/update_weights_from_disk",
        {"model_path": str(tiny.bf16_other), "weight_version": "3"},
    )
    assert reply.status_code == 200
    assert reply.json()["message"].endswith("Weight version updated to 3.")
    info = httpx.get(f"{engine.url}/model_info").json()
    assert info["weight_version"] == "3"
    assert info["model_path"] == str(tiny.bf16_other.resolve())
    assert greedy_ids(engine) != before
    served = post(engine, "/weights_checker", {"action": "checksum"}).json()["message"]
    assert served == weights_checksum(dequantized_tensors(tiny.bf16_other)[0])
    post(engine, "/update_weights_from_disk", {"model_path": str(tiny.bf16), "weight_version": "4"})
    assert greedy_ids(engine) == before


def test_a_failed_update_keeps_weights_and_version(engine, tiny):
    version = httpx.get(f"{engine.url}/model_info").json()["weight_version"]
    before = greedy_ids(engine)
    reply = post(
        engine,
        "/update_weights_from_disk",
        {"model_path": str(tiny.bf16 / "missing"), "weight_version": "99"},
    )
    assert reply.status_code == 400
    assert reply.json()["success"] is False and "Rolling back" in reply.json()["message"]
    assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == version
    assert greedy_ids(engine) == before


def test_update_without_pause_waits_for_running_requests_to_finish_on_old_weights(engine, tiny):
    with ThreadPoolExecutor(2) as pool:
        running: Future = pool.submit(
            post, engine, "/generate", {"text": "2+2=", "sampling_params": LONG}
        )
        wait_until(running_one(engine), DEADLINE_S, "the request to run", 0.02)
        update = post(
            engine,
            "/update_weights_from_disk",
            {"model_path": str(tiny.bf16), "weight_version": "w5"},
        )
        assert update.json()["success"]
        meta = running.result(timeout=DEADLINE_S).json()["meta_info"]
    # every token came from the old weights: the writer waited for the request to finish
    assert meta["completion_tokens"] == LONG["max_new_tokens"]
    assert len(meta["weight_versions"]) == 1 and meta["weight_versions"][0]["version"] != "w5"


def test_pause_abort_returns_in_flight_requests_and_blocks_new_ones_until_continue(engine):
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, engine, "/generate", {"text": "1", "sampling_params": ENDLESS})
        wait_until(running_one(engine), DEADLINE_S, "the request to run", 0.02)
        assert post(engine, "/pause_generation", {"mode": "abort"}).status_code == 200
        # pause(abort) returns only after the in-flight request has been answered
        assert state(engine)["in_flight"] == 0
        aborted = running.result(timeout=DEADLINE_S).json()["meta_info"]
        assert aborted["finish_reason"]["type"] == "abort"
        assert 0 < aborted["completion_tokens"] < ENDLESS["max_new_tokens"]
        blocked = pool.submit(
            post, engine, "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 2}}
        )
        gate = state(engine)
        assert gate["paused"] and gate["num_running_reqs"] == gate["num_waiting_reqs"] == 0
        assert not blocked.done()
        post(engine, "/continue_generation", {})
        assert blocked.result().json()["meta_info"]["completion_tokens"] == 2


def test_pause_retract_reprefills_on_the_new_weights_and_counts_the_retraction(engine, tiny):
    with streaming(engine, {"text": "5+5=", "sampling_params": LONG}) as chunks:
        post(engine, "/pause_generation", {"mode": "retract"})
        assert state(engine)["num_waiting_reqs"] == 1
        update = post(
            engine,
            "/update_weights_from_disk",
            {"model_path": str(tiny.nvfp4), "weight_version": "r6", "flush_cache": True},
        ).json()
        assert update["success"], update  # 0.5.21+: the waiting queue is ignored while paused
        post(engine, "/continue_generation", {})
        final = last(chunks)["meta_info"]
    assert final["num_retractions"] == 1
    assert [s["version"] for s in final["weight_versions"]][-1] == "r6"
    assert final["completion_tokens"] == LONG["max_new_tokens"]
    post(engine, "/update_weights_from_disk", {"model_path": str(tiny.bf16), "weight_version": "7"})


def test_flush_cache_fails_while_requests_are_held_in_place(engine, tiny):
    with streaming(engine, {"text": "3", "rid": "held", "sampling_params": ENDLESS}):
        post(engine, "/pause_generation", {"mode": "in_place"})
        flushed = httpx.post(f"{engine.url}/flush_cache")
        assert flushed.status_code == 400 and flushed.text == "Flush cache failed.\n"
        label = httpx.get(f"{engine.url}/model_info").json()["weight_version"]
        reply = post(
            engine,
            "/update_weights_from_disk",
            {"model_path": str(tiny.bf16), "weight_version": "never", "flush_cache": True},
        )
        # SGLang 0.5.22+: 400 with the weights already swapped and the label unchanged
        assert reply.status_code == 400
        assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == label
        post(engine, "/continue_generation", {})
        post(engine, "/abort_request", {"rid": "held"})


def test_update_weight_version_relabels_without_touching_weights(engine):
    before = greedy_ids(engine)
    reply = post(
        engine, "/update_weight_version", {"new_version": "relabel", "abort_all_requests": False}
    )
    assert reply.json() == {
        "success": True,
        "message": "Weight version updated to relabel",
        "new_version": "relabel",
    }
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    out = post(engine, "/generate", {"text": "4+4=", "sampling_params": params}).json()
    assert out["output_ids"] == before
    assert out["meta_info"]["weight_versions"] == [{"version": "relabel", "start": 0, "end": 8}]
