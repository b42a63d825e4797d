"""The reference engine serves FP8 and NVFP4 folders from the converter (real processes)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import httpx
import pytest

from reference_engine.engine import weights_checksum
from reference_engine.weights import dequantized_tensors
from tests.fixtures.reference_engine import (
    TETHER,
    ReferenceEngineProcess,
    launch_reference_engine,
    wait_until_ready,
)

PROMPT = {
    "text": "6+7=",
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
    "return_logprob": True,
    "top_logprobs_num": 5,
}


@pytest.fixture(scope="module")
def quantized_engines(tiny, tmp_path_factory) -> Iterator[dict[str, ReferenceEngineProcess]]:
    """An FP8 and an NVFP4 engine, started side by side."""
    logs = tmp_path_factory.mktemp("logs")
    engines = {
        "fp8": launch_reference_engine(tiny.fp8, logs / "fp8.log", "--precision", "fp8"),
        "nvfp4": launch_reference_engine(tiny.nvfp4, logs / "nvfp4.log", "--precision", "nvfp4"),
    }
    try:
        for engine in engines.values():
            wait_until_ready(engine)
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantized_engine_serves_the_dequantized_converter_output(
    quantized_engines, bf16_engine, tiny, precision
):
    engine = quantized_engines[precision]
    folder = getattr(tiny, precision)
    assert httpx.get(f"{engine.url}/model_info").json()["precision"] == precision
    served = httpx.post(f"{engine.url}/weights_checker", json={}).json()["message"]
    assert served == weights_checksum(dequantized_tensors(folder)[0])
    quantized = httpx.post(f"{engine.url}/generate", json=PROMPT, timeout=60).json()
    reference = httpx.post(f"{bf16_engine.url}/generate", json=PROMPT, timeout=60).json()
    assert quantized["meta_info"]["completion_tokens"] == 4
    # same first-step distribution up to quantization noise: compare the logprobs the
    # quantized engine gives to the BF16 engine's top-5 candidates
    ref_top = {t[1]: t[0] for t in reference["meta_info"]["output_top_logprobs"][0]}
    got_top = {t[1]: t[0] for t in quantized["meta_info"]["output_top_logprobs"][0]}
    shared = set(ref_top) & set(got_top)
    assert shared
    assert all(abs(ref_top[t] - got_top[t]) < 0.25 for t in shared)


def test_an_engine_started_for_fp8_refuses_a_bf16_update(quantized_engines, tiny):
    engine = quantized_engines["fp8"]
    reply = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={"model_path": str(tiny.bf16), "weight_version": "x"},
        timeout=60,
    )
    assert reply.status_code == 400 and "convert it" in reply.json()["message"]
    assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == "default"


def test_starting_with_the_wrong_precision_exits_non_zero_with_a_message(tiny):
    done = subprocess.run(
        [TETHER, "engine", "reference", "--model", str(tiny.bf16), "--port", "0",
         "--precision", "nvfp4"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "holds a bf16 checkpoint" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr
