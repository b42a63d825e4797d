"""What a rollout request returns, parsed from the engine's answer into typed values.

Owns the reading of SGLang's native `/generate` body (`text`, `output_ids`, `meta_info` with
`output_token_logprobs`, `output_top_logprobs`, `weight_version(s)`) and of the OpenAI chat
body (`choices[0]`, `logprobs.content`, `metadata`), plus the Tether stamps the router and
the agent add (`weight_version_start`/`_end`, `engine_id`, `precision`). Pure parsing: it
never sends a request and never decides whether a version is acceptable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from store.types import VersionConstraint
from wire import ENGINE_ID_HEADER, VERSION_END_HEADER, VERSION_START_HEADER


class MalformedRollout(ValueError):
    """The engine's answer lacks what a rollout needs (e.g. no version stamp).

    Recovery: none by retrying; the engine or agent in between is not speaking Tether's API.
    """


@dataclass(frozen=True)
class TokenLogprob:
    """One candidate token at one position: its id (None in OpenAI bodies), text, logprob."""

    logprob: float
    token_id: int | None = None
    token: str | None = None


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens [start, end) were generated under `version`."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class RolloutResult:
    """One completed rollout and where every token of it came from."""

    text: str
    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[TokenLogprob]]
    weight_version_start: int
    weight_version_end: int
    engine_id: str | None
    precision: str | None
    retries: int
    constraint: VersionConstraint
    finish_reason: Any = None
    not_ready_retries: int = 0
    spans: list[VersionSpan] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def oldest_version(self) -> int:
        """The oldest version any token came from (what staleness is measured against)."""
        return min(self.versions)

    @property
    def versions(self) -> list[int]:
        """Every version stamped on the answer: start, end and each span's."""
        return [
            self.weight_version_start,
            self.weight_version_end,
            *(span.version for span in self.spans),
        ]

    @property
    def satisfies_constraint(self) -> bool:
        """True if every token came from a version the request's constraint accepts."""
        return all(self.constraint.satisfied_by(v) for v in self.versions)


def _int_or_none(value: object) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _triple(entry: object) -> TokenLogprob | None:
    """SGLang's `[logprob, token_id, text]` triple."""
    if isinstance(entry, (list, tuple)) and len(entry) >= 2 and entry[0] is not None:
        text = entry[2] if len(entry) > 2 else None
        return TokenLogprob(float(entry[0]), _int_or_none(entry[1]), text)
    return None


def _versions(
    body: Mapping[str, Any], meta: Mapping[str, Any], headers: Mapping[str, str]
) -> tuple[int, int, list[VersionSpan]]:
    spans = [
        VersionSpan(int(v), int(s["start"]), int(s["end"]))
        for s in meta.get("weight_versions") or []
        if isinstance(s, Mapping) and (v := _int_or_none(s.get("version"))) is not None
    ]
    start = _int_or_none(body.get("weight_version_start"))
    if start is None:
        start = _int_or_none(headers.get(VERSION_START_HEADER))
    end = _int_or_none(body.get("weight_version_end"))
    if end is None:
        end = _int_or_none(headers.get(VERSION_END_HEADER))
    fallback = _int_or_none(meta.get("weight_version"))
    if start is None:
        start = spans[0].version if spans else fallback
    if end is None:
        end = spans[-1].version if spans else fallback
    if start is None or end is None:
        raise MalformedRollout(
            "the answer carries no weight version (expected weight_version_start/_end or "
            "meta_info.weight_version); is the request going through Tether's router or agent?"
        )
    return start, end, spans


@dataclass(frozen=True)
class Delivery:
    """How an answer arrived: its headers, the constraint it was sent with, the retries."""

    headers: Mapping[str, str]
    constraint: VersionConstraint
    retries: int = 0
    not_ready_retries: int = 0


def _result(
    body: Mapping[str, Any], meta: Mapping[str, Any], delivery: Delivery, **content: Any
) -> RolloutResult:
    """A result from parsed content plus the stamps every answer carries."""
    start, end, spans = _versions(body, meta, delivery.headers)
    return RolloutResult(
        **content,
        weight_version_start=start,
        weight_version_end=end,
        engine_id=body.get("engine_id") or delivery.headers.get(ENGINE_ID_HEADER),
        precision=body.get("precision"),
        retries=delivery.retries,
        not_ready_retries=delivery.not_ready_retries,
        constraint=delivery.constraint,
        spans=spans,
        raw=dict(body),
    )


def parse_generate(body: Mapping[str, Any], delivery: Delivery) -> RolloutResult:
    """A result from SGLang's native `/generate` answer (one prompt)."""
    if not isinstance(body, Mapping):
        raise MalformedRollout(f"expected one generate object, got {type(body).__name__}")
    meta = body.get("meta_info") or {}
    tokens = [t for t in (_triple(e) for e in meta.get("output_token_logprobs") or []) if t]
    output_ids = [int(i) for i in body.get("output_ids") or []]
    if not output_ids:
        output_ids = [t.token_id for t in tokens if t.token_id is not None]
    top = [
        [t for t in (_triple(e) for e in position or []) if t is not None]
        for position in meta.get("output_top_logprobs") or []
    ]
    return _result(
        body,
        meta,
        delivery,
        text=str(body.get("text", "")),
        output_ids=output_ids,
        logprobs=[t.logprob for t in tokens],
        top_logprobs=top,
        finish_reason=meta.get("finish_reason"),
    )


def parse_chat(body: Mapping[str, Any], delivery: Delivery) -> RolloutResult:
    """A result from an OpenAI `/v1/chat/completions` answer (its first choice)."""
    choices = body.get("choices") or []
    if not choices:
        raise MalformedRollout("the chat answer has no choices")
    choice = choices[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return _result(
        body,
        dict(body.get("metadata") or {}),
        delivery,
        text=str((choice.get("message") or {}).get("content") or ""),
        output_ids=[int(i) for i in choice.get("token_ids") or body.get("output_ids") or []],
        logprobs=[float(item["logprob"]) for item in content],
        top_logprobs=[
            [TokenLogprob(float(t["logprob"]), None, t.get("token")) for t in item["top_logprobs"]]
            for item in content
            if item.get("top_logprobs")
        ],
        finish_reason=choice.get("finish_reason"),
    )
