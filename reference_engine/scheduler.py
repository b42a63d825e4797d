"""The reference engine's scheduler: one thread that advances every live request a token
at a time, round robin, and the only place the model runs.

Owns the waiting and running queues, the scheduler pause (`in_place` holds every running
request between two tokens with its KV cache; `retract` frees the caches and re-prefills
prompt + output on resume; `abort` finishes everything), aborts by rid prefix, the two
weight-version registers (the label `/model_info` reports and the scheduler version that
attributes tokens), and swapping weights in place. Lock order is always `_model_lock`
then `_cv`: a control operation that holds `_model_lock` knows no forward pass is running,
so weights and requests change only between two tokens. Must never speak HTTP or decide
admission (that is `reference_engine.gate`).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

from reference_engine.request import GenerationRequest
from reference_engine.sampling import choose_token
from reference_engine.weights import copy_into

log = logging.getLogger(__name__)


class DuplicateRequest(ValueError):
    """A request id that is already in flight."""


def _abort_reason(message: str, status_code: int | None = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


class Scheduler:
    """Runs requests on one model; thread-safe entry points for the HTTP layer."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        weight_version: str,
        max_running_requests: int = 16,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.label = weight_version
        self.scheduler_version = weight_version
        self._max_running = max_running_requests
        self._model_lock = threading.Lock()
        self._cv = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[GenerationRequest] = []
        self._paused = False
        self._stopping = False
        self._turn = 0
        self.generated_tokens = 0
        self._eos_ids = self._collect_eos_ids()
        # transformers renamed `past_key_values` to `cache` (5.x); use whichever it takes.
        forward_args = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self._thread = threading.Thread(target=self._loop, name="reference-scheduler", daemon=True)

    def _collect_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(source)
        return ids

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- entry points ----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises `DuplicateRequest` if its rid is in flight."""
        with self._cv:
            if any(r.rid == request.rid for r in (*self._running, *self._waiting)):
                raise DuplicateRequest(f"Duplicate request ID detected: {request.rid}")
            self._waiting.append(request)
            self._cv.notify_all()

    def pause(self, mode: str) -> None:
        """Hold (`in_place`), retract (`retract`) or abort (`abort`) everything in flight."""
        with self._model_lock, self._cv:
            if mode == "abort":
                self._abort_where(lambda r: True)
                return
            self._paused = True
            if mode == "retract":
                for request in self._running:
                    request.retract()
                self._waiting.extendleft(reversed(self._running))
                self._running = []

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False, exact: bool = False) -> int:
        """Abort requests whose rid starts with `rid` (equals it with `exact`; all with
        `abort_all`); return how many."""
        if not rid and not abort_all:
            return 0

        def match(request: GenerationRequest) -> bool:
            return abort_all or (request.rid == rid if exact else request.rid.startswith(rid))

        with self._model_lock, self._cv:
            return self._abort_where(match)

    def swap_weights(self, tensors: dict[str, torch.Tensor], new_version: str | None) -> int:
        """Copy weights in place between two tokens; move the scheduler version."""
        with self._model_lock, self._cv:
            count = copy_into(self.model, tensors)
            if new_version is not None:
                self._move_version(new_version)
            return count

    def set_version(self, new_version: str) -> None:
        """Relabel without touching weights (SGLang's `/update_weight_version`)."""
        with self._model_lock, self._cv:
            self._move_version(new_version)
            self.label = new_version

    def is_idle(self, ignore_waiting: bool) -> bool:
        with self._cv:
            return not self._running and (ignore_waiting or not self._waiting)

    def load(self) -> dict[str, int]:
        with self._cv:
            return {
                "num_running_reqs": len(self._running),
                "num_waiting_reqs": len(self._waiting),
                "generated_tokens": self.generated_tokens,
            }

    # -- internals (caller holds the locks) ------------------------------------------------

    def _move_version(self, new_version: str) -> None:
        if new_version == self.scheduler_version:
            return
        for request in (*self._running, *self._waiting):
            request.mark_version_change(self.scheduler_version)
        log.info("scheduler weight version %s -> %s", self.scheduler_version, new_version)
        self.scheduler_version = new_version

    def _abort_where(self, match: Callable[[GenerationRequest], bool]) -> int:
        hit = 0
        for request in [r for r in self._running if match(r)]:
            self._running.remove(request)
            self._finish(request, _abort_reason("Aborted"))
            hit += 1
        for request in [r for r in self._waiting if match(r)]:
            self._waiting.remove(request)
            running_before = request.cache is not None or request.output_ids
            self._finish(
                request, _abort_reason("Aborted" if running_before else "Abort in waiting queue")
            )
            hit += 1
        return hit

    def _payload(self, request: GenerationRequest) -> dict:
        return request.response(self.label, self.scheduler_version, self._token_text)

    def _detokenize(self, request: GenerationRequest) -> Callable[[list[int]], str]:
        skip = request.params.skip_special_tokens
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _finish(self, request: GenerationRequest, reason: dict) -> None:
        request.finish_reason = reason
        request.cache = None
        request.sink(self._payload(request), True)

    # -- the loop --------------------------------------------------------------------------

    def _next_request(self) -> GenerationRequest | None:
        with self._cv:
            while not self._stopping and (self._paused or not (self._running or self._waiting)):
                self._cv.wait()
            if self._stopping:
                return None
            while self._waiting and len(self._running) < self._max_running:
                self._running.append(self._waiting.popleft())
            self._turn = (self._turn + 1) % len(self._running)
            return self._running[self._turn]

    def _loop(self) -> None:
        while (request := self._next_request()) is not None:
            with self._model_lock:
                with self._cv:
                    if self._paused or request not in self._running:
                        continue
                    if request.params.max_new_tokens == 0:
                        self._running.remove(request)
                        self._finish(request, {"type": "length", "length": 0})
                        continue
                try:
                    token, logprobs = self._forward(request)
                except Exception as exc:
                    log.exception("request %s failed in the forward pass", request.rid)
                    with self._cv:
                        if request in self._running:
                            self._running.remove(request)
                            self._finish(request, _abort_reason(f"engine error: {exc}", 500))
                    continue
                with self._cv:
                    self._append(request, token, logprobs)

    def _forward(self, request: GenerationRequest) -> tuple[int, torch.Tensor]:
        from transformers import DynamicCache

        want_prompt = (
            request.return_logprob and request.logprob_start_len >= 0 and not request.input_logprobs
        )
        if request.cache is None:
            request.cache = DynamicCache(config=self.model.config)  # type: ignore[arg-type]
            feed = request.input_ids + request.output_ids
        else:
            feed = request.output_ids[-1:]
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([feed], dtype=torch.long),
                use_cache=True,
                logits_to_keep=0 if want_prompt else 1,
                **{self._cache_kwarg: request.cache},
            )
        logits = out.logits[0].to(torch.float32)
        if want_prompt:
            self._record_prompt_logprobs(request, logits[: len(request.input_ids)])
        return choose_token(
            logits[-1], request.params, request.generator, request.input_ids, request.output_ids
        )

    def _record_prompt_logprobs(self, request: GenerationRequest, logits: torch.Tensor) -> None:
        rows = torch.log_softmax(logits[:-1], dim=-1)
        targets = torch.tensor(request.input_ids[1:], dtype=torch.long)
        picked = rows.gather(1, targets[:, None])[:, 0].tolist() if len(targets) else []
        request.input_logprobs = [None, *picked]
        request.input_top = [None]
        for row in rows:
            request.input_top.append(self._top(row, request.top_logprobs_num))

    @staticmethod
    def _top(row: torch.Tensor, k: int) -> list[tuple[float, int]]:
        if k <= 0:
            return []
        values, ids = torch.topk(row, min(k, row.shape[0]))
        return list(zip(values.tolist(), ids.tolist(), strict=True))

    def _append(self, request: GenerationRequest, token: int, logprobs: torch.Tensor) -> None:
        if request not in self._running:
            return
        request.output_ids.append(token)
        self.generated_tokens += 1
        request.output_logprobs.append(float(logprobs[token]))
        if request.top_logprobs_num > 0:
            request.output_top.append(self._top(logprobs, request.top_logprobs_num))
        params = request.params
        request.text = self._detokenize(request)(request.output_ids)
        reason = None
        enough = len(request.output_ids) >= params.min_new_tokens
        if (enough and not params.ignore_eos and token in self._eos_ids) or (
            enough and token in params.stop_token_ids
        ):
            reason = {"type": "stop", "matched": token}
        elif enough and (hit := next((s for s in params.stop if s and s in request.text), None)):
            if not params.no_stop_trim:
                request.text = request.text[: request.text.index(hit)]
            reason = {"type": "stop", "matched": hit}
        elif len(request.output_ids) >= params.max_new_tokens:
            reason = {"type": "length", "length": params.max_new_tokens}
        if reason is not None:
            self._running.remove(request)
            self._finish(request, reason)
        elif request.stream:
            request.sink(self._payload(request), False)
