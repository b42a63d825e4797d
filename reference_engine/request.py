"""One generation request inside the reference engine, and its SGLang-shaped output.

Owns a request's progress (output ids, logprobs, KV cache, retractions), its weight
version events and the spans computed from them (half-open over output-token indices,
contiguous from 0 to `completion_tokens`, equal neighbours merged; the finished
`meta_info.weight_version` is the last span's version), and the `{text, output_ids,
meta_info}` dict SGLang's `/generate` returns. Must never run the model or choose tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reference_engine.sampling import SamplingParams


def weight_version_spans(
    events: list[tuple[str, int]], final_version: str, completion_tokens: int
) -> list[dict]:
    """Spans from `(old_version, tokens_so_far)` events and the version at finish."""
    spans: list[dict] = []
    start = 0
    for version, end in [*events, (final_version, completion_tokens)]:
        end = min(end, completion_tokens)
        if end <= start:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        else:
            spans.append({"version": version, "start": start, "end": end})
        start = end
    if not spans:
        spans.append({"version": final_version, "start": 0, "end": completion_tokens})
    return spans


@dataclass
class GenerationRequest:
    """Live state of one request; the scheduler thread is its only writer."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    sink: Callable[[dict, bool], None]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra_key: str | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    cache: Any = None
    fed: int = 0
    num_retractions: int = 0
    version_events: list[tuple[str, int]] = field(default_factory=list)
    finish_reason: dict | None = None
    text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def mark_version_change(self, old_version: str) -> None:
        """Record that tokens so far came from `old_version` (only if there are any)."""
        if self.output_ids:
            self.version_events.append((old_version, len(self.output_ids)))

    def retract(self) -> None:
        """Free the KV cache; the next step re-prefills prompt + output so far."""
        self.cache = None
        self.fed = 0
        self.num_retractions += 1

    def response(
        self,
        label: str,
        scheduler_version: str,
        token_text: Callable[[int], str],
    ) -> dict:
        """The SGLang `/generate` object for this request as it stands now."""

        def triple(lp: float | None, tid: int) -> list:
            return [lp, tid, token_text(tid) if self.return_text_in_logprobs else None]

        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "num_retractions": self.num_retractions,
            "weight_version": label,
        }
        if self.extra_key is not None:
            meta["extra_key"] = self.extra_key
        if self.return_logprob:
            meta["output_token_logprobs"] = [
                triple(lp, tid)
                for lp, tid in zip(self.output_logprobs, self.output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(self.output_ids)
            if self.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    [triple(lp, tid) for lp, tid in top] for top in self.output_top
                ]
            if self.logprob_start_len >= 0:
                start = self.logprob_start_len
                ids = self.input_ids[start:]
                meta["input_token_logprobs"] = [
                    triple(lp, tid)
                    for lp, tid in zip(self.input_logprobs[start:], ids, strict=True)
                ]
                if self.top_logprobs_num > 0:
                    meta["input_top_logprobs"] = [
                        None if top is None else [triple(lp, tid) for lp, tid in top]
                        for top in self.input_top[start:]
                    ]
        if self.finished:
            spans = weight_version_spans(
                self.version_events, scheduler_version, len(self.output_ids)
            )
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
