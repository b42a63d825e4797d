"""The reference engine: a Hugging Face causal LM on CPU behind SGLang's control semantics.

Owns building the model once from a checkpoint folder (any precision, dequantized for
compute), running generations through the pause gate and the scheduler, and the control
operations (pause, continue, update from disk, relabel, abort) with SGLang's outcomes.
Updates copy weights into the live model, never rebuild it. Must never parse HTTP bodies
(that is `reference_engine.app`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_agent.precision.checkpoint import read_config
from reference_engine.gate import PauseGate
from reference_engine.request import GenerationRequest
from reference_engine.sampling import SamplingParams, make_generator
from reference_engine.scheduler import Scheduler
from reference_engine.settings import ReferenceEngineSettings
from reference_engine.weights import checkpoint_precision, copy_into, dequantized_tensors

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class PrecisionMismatch(ValueError):
    """A checkpoint whose precision differs from the one the engine was started for."""


@dataclass
class RequestSpec:
    """What one generation asks for, before it becomes a live request."""

    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    extra_key: str | None = None


@dataclass(frozen=True)
class UpdateOutcome:
    """Result of `/update_weights_from_disk`: SGLang's reply plus the time it took."""

    success: bool
    message: str
    seconds: float

    def body(self) -> dict:
        return {
            "success": self.success,
            "message": self.message,
            "num_paused_requests": 0,
            "load_seconds": round(self.seconds, 6),
        }


def weights_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, BF16 bytes) in name order: equal for a folder and the engine
    that loaded it, and for BF16 equal to the canonical tensors' bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(
            tensors[name].detach().to(torch.bfloat16).contiguous().view(torch.uint8).numpy().data
        )
    return digest.hexdigest()


def build_model(folder: str | Path, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """Construct the architecture from config.json and copy the (dequantized) weights in."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = read_config(folder)
    config.pop("quantization_config", None)
    hf_config = AutoConfig.for_model(**config)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    tensors, precision = dequantized_tensors(folder)
    copy_into(model, tensors)
    model.eval()
    return model, precision


class ReferenceEngine:
    """One served model; its methods are called from the HTTP event loop."""

    def __init__(self, settings: ReferenceEngineSettings) -> None:
        from transformers import AutoTokenizer

        started = time.perf_counter()
        self.settings = settings
        torch.set_num_threads(settings.threads)
        self.model_path = str(Path(settings.model_path).resolve())
        dtype = torch.float32 if settings.dtype == "float32" else torch.bfloat16
        self.config = read_config(self.model_path)
        self._check_precision(checkpoint_precision(self.config), self.model_path)
        model, self.precision = build_model(self.model_path, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.served_model_name = settings.served_model_name or self.model_path
        self.scheduler = Scheduler(
            model, self.tokenizer, settings.weight_version, settings.max_running_requests
        )
        self.gate = PauseGate()
        self.last_update: UpdateOutcome | None = None
        self.startup_seconds = time.perf_counter() - started
        self.started_at = time.time()

    def _check_precision(self, found: str, folder: str) -> None:
        wanted = self.settings.precision
        if wanted != "auto" and wanted != found:
            raise PrecisionMismatch(
                f"engine serves {wanted} but {folder} holds a {found} checkpoint; convert it "
                f"with `engine_agent.precision.convert_checkpoint(..., {wanted!r}, ...)` or "
                "start the engine with --precision auto"
            )

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    # -- generation ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def generate(
        self, specs: list[RequestSpec], stream: bool
    ) -> AsyncIterator[tuple[int, dict, bool]]:
        """Yield `(index, payload, finished)` for each chunk of each spec, through the gate.

        Leaving early (client gone) aborts whatever has not finished.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, dict, bool]] = asyncio.Queue()
        async with self.gate.generation():
            submitted: list[GenerationRequest] = []
            done: set[int] = set()
            try:
                for index, spec in enumerate(specs):
                    request = self._live_request(spec, stream, index, loop, queue)
                    self.scheduler.submit(request)
                    submitted.append(request)
                while len(done) < len(specs):
                    index, payload, finished = await queue.get()
                    if finished:
                        done.add(index)
                    yield index, payload, finished
            finally:
                for index, request in enumerate(submitted):
                    if index not in done:
                        await asyncio.to_thread(self.scheduler.abort, request.rid, False, True)

    def _live_request(self, spec, stream, index, loop, queue) -> GenerationRequest:
        def sink(payload: dict, finished: bool) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, payload, finished))

        return GenerationRequest(
            rid=spec.rid,
            input_ids=list(spec.input_ids),
            params=spec.params,
            generator=make_generator(spec.params.sampling_seed),
            sink=sink,
            return_logprob=spec.return_logprob,
            top_logprobs_num=spec.top_logprobs_num,
            logprob_start_len=spec.logprob_start_len,
            return_text_in_logprobs=spec.return_text_in_logprobs,
            stream=stream,
            extra_key=spec.extra_key,
        )

    async def health_probe(self) -> bool:
        """SGLang's generation health check: a 1-token request must come back in time."""
        timeout = self.settings.health_check_timeout_s
        if not self.scheduler.alive or not await self.gate.wait_unpaused(timeout):
            return False
        spec = RequestSpec(
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        )

        async def one() -> bool:
            async for _index, _payload, finished in self.generate([spec], stream=False):
                if finished:
                    return True
            return False

        try:
            return await asyncio.wait_for(one(), timeout)
        except TimeoutError:
            return False

    # -- control ---------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        await self.gate.pause()
        await asyncio.to_thread(self.scheduler.pause, mode)
        if mode == "abort":
            await self.gate.wait_drained()

    async def resume(self) -> None:
        await self.gate.resume()
        self.scheduler.resume()

    async def abort(self, rid: str, abort_all: bool) -> int:
        return await asyncio.to_thread(self.scheduler.abort, rid, abort_all)

    def flush_cache(self) -> bool:
        """No prefix cache is kept; succeeds exactly when SGLang's would (idle)."""
        return self.scheduler.is_idle(ignore_waiting=self.gate.paused)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool) -> None:
        if abort_all_requests:
            await self.abort("", True)
        await asyncio.to_thread(self.scheduler.set_version, new_version)

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
    ) -> UpdateOutcome:
        """Load a folder and copy it in place; the label moves only on full success."""
        started = time.perf_counter()
        if abort_all_requests:
            await self.abort("", True)
        async with self.gate.writer():
            try:
                tensors, precision = await asyncio.to_thread(dequantized_tensors, model_path)
                self._check_precision(precision, model_path)
                await asyncio.to_thread(self.scheduler.swap_weights, tensors, weight_version)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                outcome = UpdateOutcome(
                    False,
                    f"Failed to update weights: {exc}. Rolling back to original weights.",
                    time.perf_counter() - started,
                )
                log.warning("update from %s failed: %s", model_path, exc)
                self.last_update = outcome
                return outcome
            self.model_path = str(Path(model_path).resolve())
            self.served_model_name = self.model_path
            self.precision = precision
            if flush_cache and not self.flush_cache():
                outcome = UpdateOutcome(
                    False,
                    "Failed to flush cache after updating weights: requests are running "
                    "(weights are already swapped; never send flush_cache=true under in_place)",
                    time.perf_counter() - started,
                )
                self.last_update = outcome
                return outcome
            if weight_version is not None:
                self.scheduler.label = weight_version
        seconds = time.perf_counter() - started
        message = f"Succeeded to update model weights in {seconds:.3f}s."
        if weight_version is not None:
            message += f" Weight version updated to {weight_version}."
        log.info(
            "weights updated from %s (version %s) in %.3fs", model_path, weight_version, seconds
        )
        self.last_update = UpdateOutcome(True, message, seconds)
        return self.last_update

    def served_checksum(self) -> str:
        return weights_checksum(dict(self.scheduler.model.named_parameters()))
