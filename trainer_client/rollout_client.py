"""The RolloutClient: version-pinned generation through the control plane's router.

Owns the trainer's request side: turning `min_version` / `exact_version` / `max_lag` into the
`weight_version` field (with `max_lag`, min = latest − lag, latest read from the control plane
and cached briefly), retrying a retryable answer (409 `WeightVersionNotReady`, 503) with
exponential backoff and full jitter, honouring `Retry-After`, until a deadline, and counting
every retry. A refusal that waiting cannot change fails at once with its own exception:
`VersionUnavailable` (the version will not be served again; it carries the nearest
servable version), `PrecisionUnavailable` (no engine of that precision), and
`RolloutRequestInvalid` for every other 4xx (unknown run, impossible constraint).
It never chooses an engine itself: the router does, or, with `direct=True`,
`DirectRoutes` balances over the candidate sets the control plane lists
(`trainer_client/direct_routes.py`) and calls engines directly. It never accepts an answer
whose stamped version breaks the request's constraint: such an answer raises
`ConstraintViolated`, because a trainer must not learn from tokens of the wrong policy.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from store.types import VersionConstraint, validate_run_id, validate_version
from trainer_client.direct_routes import DirectRoutes, stamp
from trainer_client.notifier import auth_headers, error_text
from trainer_client.rollout_result import (
    Delivery,
    MalformedRollout,
    RolloutResult,
    parse_chat,
    parse_generate,
)
from wire import SESSION_HEADER

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """A rollout request failed for good; the message says why and what to change."""


class RolloutRequestInvalid(RolloutError):
    """The control plane refused the request itself (4xx other than 409). Do not retry."""


class VersionUnavailable(RolloutRequestInvalid):
    """409 `WeightVersionUnavailable`: no engine serves the exact version and none will
    (older than the run's policy keeps, or garbage-collected). Ask for
    `nearest_servable_version` (or a `min_version`) instead."""

    def __init__(self, message: str, nearest_servable_version: int | None) -> None:
        super().__init__(message)
        self.nearest_servable_version = nearest_servable_version


class PrecisionUnavailable(RolloutRequestInvalid):
    """409 `PrecisionNotServed`: the run has engines, none of the requested precision.
    Widen `precision` or start an engine of that precision."""

    def __init__(self, message: str, fleet_precisions: list[str]) -> None:
        super().__init__(message)
        self.fleet_precisions = fleet_precisions


class RolloutDeadlineExceeded(RolloutError):
    """No engine could serve the requested version before the deadline.

    Recovery: loosen the constraint (a larger `max_lag`), wait for engines to catch up, or
    give the request a longer deadline.
    """


class ConstraintViolated(RolloutError):
    """An answer was stamped with a version outside the request's constraint. A bug in the
    router or agent; the tokens must not be used for training."""


@dataclass
class RolloutStats:
    """Counters over the client's lifetime (read them, or `snapshot()` and diff)."""

    requests: int = 0
    completed: int = 0
    retries_409: int = 0
    retries_503: int = 0
    transport_retries: int = 0
    deadline_exceeded: int = 0
    latest_lookups: int = 0
    gap_reports: int = 0
    gap_reports_failed: int = 0

    def snapshot(self) -> RolloutStats:
        return RolloutStats(**vars(self))

    @property
    def retries(self) -> int:
        return self.retries_409 + self.retries_503 + self.transport_retries


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """The `Retry-After` delay in seconds (numeric form only), or None."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The `error` object of a Tether error answer ({} for any other body)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def refusal_of(path: str, response: httpx.Response) -> RolloutRequestInvalid | None:
    """The exception for an answer that must not be retried; None for a retryable one
    (409 `WeightVersionNotReady` or any 409 that says `retryable`, and 503)."""
    status = response.status_code
    if status == 503:
        return None
    error = error_of(response)
    message = f"{path} answered {status}: {error_text(response)}"
    if status == 409:
        kind = error.get("type")
        if kind == "WeightVersionUnavailable":
            return VersionUnavailable(message, error.get("nearest_servable_version"))
        if kind == "PrecisionNotServed":
            return PrecisionUnavailable(message, list(error.get("fleet_precisions", [])))
        if error.get("retryable", kind == "WeightVersionNotReady"):
            return None
    return RolloutRequestInvalid(message)


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base·2^attempt)]."""
    return random.uniform(0.0, min(cap_s, base_s * 2**attempt))


class RolloutClient:
    """Async client of the control plane's generate routes for one run.

    `control_plane`: the control plane's base URL; `token`: a client or trainer token;
    `run_id`: the run (may be omitted when the control plane knows only one).
    `deadline_s`: how long one call may keep retrying; `latest_ttl_s`: how long a read of
    the latest version is reused for `max_lag`. `direct`: call engines directly, balanced
    over the control plane's cached candidate sets (`GET /v1/routes`), instead of through
    its router (needs network reach to every engine; see docs/api.md). Use as
    `async with RolloutClient(...)`.
    """

    def __init__(
        self,
        control_plane: str,
        token: str | None = None,
        *,
        run_id: str | None = None,
        deadline_s: float = 60.0,
        backoff_base_s: float = 0.05,
        backoff_cap_s: float = 2.0,
        latest_ttl_s: float = 0.5,
        request_timeout_s: float = 300.0,
        max_connections: int = 256,
        direct: bool = False,
    ) -> None:
        self.run_id = validate_run_id(run_id) if run_id is not None else None
        self.deadline_s = deadline_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.latest_ttl_s = latest_ttl_s
        self.stats = RolloutStats()
        self._client = httpx.AsyncClient(
            base_url=control_plane.rstrip("/"),
            headers=auth_headers(token),
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections),
        )
        self.direct: DirectRoutes | None = None
        if direct:
            engines = httpx.AsyncClient(
                timeout=httpx.Timeout(request_timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=max_connections),
            )
            self.direct = DirectRoutes(self._client, engines)
        self._latest: tuple[float, int | None] | None = None
        self._latest_lock = asyncio.Lock()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()
        if self.direct is not None:
            await self.direct.engines.aclose()

    # ------------------------------------------------------------------ versions

    async def latest_version(self, *, fresh: bool = False) -> int | None:
        """The run's latest published version per the control plane (cached `latest_ttl_s`)."""
        async with self._latest_lock:
            now = time.monotonic()
            if not fresh and self._latest is not None and now - self._latest[0] < self.latest_ttl_s:
                return self._latest[1]
            run_id = await self._resolve_run()
            self.stats.latest_lookups += 1
            response = await self._client.get(f"/v1/runs/{run_id}")
            if response.status_code != 200:
                raise RolloutRequestInvalid(
                    f"cannot read run {run_id!r} from the control plane: "
                    f"{response.status_code} {error_text(response)}"
                )
            latest = response.json().get("latest_version")
            self._latest = (time.monotonic(), latest)
            return latest

    async def _resolve_run(self) -> str:
        if self.run_id is not None:
            return self.run_id
        response = await self._client.get("/v1/runs")
        runs = response.json().get("runs", []) if response.status_code == 200 else []
        if len(runs) != 1:
            raise RolloutRequestInvalid(
                f"the control plane knows {len(runs)} runs; pass run_id= to RolloutClient"
            )
        self.run_id = runs[0]["run_id"]
        return self.run_id

    async def constraint_for(
        self,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_lag: int | None = None,
    ) -> VersionConstraint:
        """The constraint a request carries: `max_lag` raises the minimum to latest − lag."""
        if max_lag is not None:
            validate_version(max_lag, "max_lag")
            latest = await self.latest_version()
            if latest is not None:
                floor = max(0, latest - max_lag)
                min_version = floor if min_version is None else max(min_version, floor)
        return VersionConstraint(min_version, exact_version)

    # ------------------------------------------------------------------ observability

    async def report_gap(
        self,
        step: int,
        gaps: Mapping[str, Any],
        *,
        trainer_version: int | None = None,
        staleness_mean: float | None = None,
        staleness_max: int | None = None,
    ) -> bool:
        """Tell the control plane one step's sampler gap per precision (`GapMetrics` or a
        mapping with `k3_kl` and optionally `logprob_abs_diff`, `masked_fraction`,
        `tokens`) and the rollouts' staleness; the dashboard and alerts read it.

        Observability must not stop training: an unreachable or failing control plane is
        logged and answers False. A refused body (4xx) is a caller bug and raises
        `RolloutRequestInvalid`."""
        run_id = await self._resolve_run()
        body = {
            "step": step,
            "trainer_version": trainer_version,
            "precisions": {name: _gap_fields(gap) for name, gap in gaps.items()},
            "staleness_mean": staleness_mean,
            "staleness_max": staleness_max,
        }
        try:
            response = await self._client.post(f"/v1/runs/{run_id}/gap", json=body)
        except httpx.TransportError as exc:
            self.stats.gap_reports_failed += 1
            log.warning("could not report the sampler gap of step %d: %s", step, exc)
            return False
        if 400 <= response.status_code < 500:
            raise RolloutRequestInvalid(
                f"/v1/runs/{run_id}/gap answered {response.status_code}: {error_text(response)}"
            )
        if response.status_code != 202:
            self.stats.gap_reports_failed += 1
            log.warning(
                "the control plane did not take the gap of step %d: %s %s",
                step,
                response.status_code,
                error_text(response),
            )
            return False
        self.stats.gap_reports += 1
        return True

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_lag: int | None = None,
        session_id: str | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        precision: str | Sequence[str] | None = None,
        deadline_s: float | None = None,
    ) -> RolloutResult:
        """Generate from a text prompt or a list of input token ids (SGLang `/generate`)."""
        body: dict[str, Any] = {
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num,
        }
        if isinstance(prompt, str):
            body["text"] = prompt
        else:
            body["input_ids"] = [int(i) for i in prompt]
        constraint = await self.constraint_for(min_version, exact_version, max_lag)
        answer, delivery = await self._send(
            "/v1/generate", body, constraint, session_id, precision, deadline_s
        )
        if isinstance(answer, list):
            if len(answer) != 1:
                raise MalformedRollout(f"expected one generate object, got {len(answer)}")
            answer = answer[0]
        return self._checked(parse_generate(answer, delivery))

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_lag: int | None = None,
        session_id: str | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        precision: str | Sequence[str] | None = None,
        deadline_s: float | None = None,
    ) -> RolloutResult:
        """Chat completion (OpenAI `/v1/chat/completions`); `sampling_params` use OpenAI
        names, and SGLang's `max_new_tokens` is accepted as `max_tokens`."""
        params = dict(sampling_params or {})
        if "max_new_tokens" in params:
            params["max_tokens"] = params.pop("max_new_tokens")
        body: dict[str, Any] = {"messages": [dict(m) for m in messages], **params}
        if return_logprob:
            body["logprobs"] = True
            if top_logprobs_num:
                body["top_logprobs"] = top_logprobs_num
        constraint = await self.constraint_for(min_version, exact_version, max_lag)
        answer, delivery = await self._send(
            "/v1/chat/completions", body, constraint, session_id, precision, deadline_s
        )
        return self._checked(parse_chat(answer, delivery))

    def _checked(self, result: RolloutResult) -> RolloutResult:
        if not result.satisfies_constraint:
            raise ConstraintViolated(
                f"engine {result.engine_id} answered with versions {sorted(set(result.versions))}, "
                f"but the request asked for {result.constraint.describe()}; discard it and "
                "report the router/agent bug"
            )
        self.stats.completed += 1
        return result

    async def _send(
        self,
        path: str,
        body: dict[str, Any],
        constraint: VersionConstraint,
        session_id: str | None,
        precision: str | Sequence[str] | None,
        deadline_s: float | None,
    ) -> tuple[Any, Delivery]:
        """POST with retries on retryable answers (409 `WeightVersionNotReady`, 503) and
        transport errors until the deadline; the answer's JSON and how it arrived."""
        if not constraint.is_any:
            body["weight_version"] = {
                "min_version": constraint.min_version,
                "exact_version": constraint.exact_version,
            }
        if self.run_id is not None:
            body["run_id"] = self.run_id
        if precision is not None:
            body["precision"] = precision if isinstance(precision, str) else list(precision)
        headers = {SESSION_HEADER: session_id} if session_id else {}
        deadline = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
        self.stats.requests += 1
        retries = not_ready = 0
        last = ""
        while True:
            engine = None
            try:
                if self.direct is None:
                    response = await self._client.post(path, json=body, headers=headers)
                else:
                    response, engine = await self.direct.post(
                        path,
                        body,
                        run_id=self.run_id,
                        constraint=constraint,
                        precisions=_precisions(precision),
                        session_id=session_id,
                        headers=headers,
                    )
            except httpx.TransportError as exc:
                self.stats.transport_retries += 1
                wait_s, last = None, f"transport error: {exc}"
            else:
                if response.status_code == 200:
                    delivery = Delivery(response.headers, constraint, retries, not_ready)
                    answer = response.json()
                    return (answer if engine is None else stamp(answer, engine)), delivery
                refused = refusal_of(path, response)
                if refused is not None:
                    raise refused
                if response.status_code == 409:
                    self.stats.retries_409 += 1
                    not_ready += 1
                else:
                    self.stats.retries_503 += 1
                wait_s = retry_after_seconds(response.headers)
                last = f"{response.status_code} {error_text(response)}"
            retries += 1
            delay = backoff_delay(retries, self.backoff_base_s, self.backoff_cap_s)
            if wait_s is not None:
                # Retry-After is the server's estimate; jitter keeps clients from waking together.
                delay = wait_s * (0.75 + 0.5 * random.random())
            left = deadline - time.monotonic()
            if left <= 0:
                self.stats.deadline_exceeded += 1
                raise RolloutDeadlineExceeded(
                    f"no engine served {constraint.describe()} within the deadline after "
                    f"{retries} attempt(s); last answer: {last}"
                )
            log.debug("retry %d of %s in %.3fs (%s)", retries, path, delay, last)
            await asyncio.sleep(min(delay, left))  # backoff, bounded by the deadline


def _precisions(precision: str | Sequence[str] | None) -> tuple[str, ...]:
    if precision is None:
        return ()
    return (precision,) if isinstance(precision, str) else tuple(sorted(set(precision)))


def _gap_fields(gap: Any) -> dict[str, Any]:
    """The wire fields of one precision's gap, from a `GapMetrics` or a mapping."""
    names = ("k3_kl", "logprob_abs_diff", "masked_fraction", "tokens")
    if isinstance(gap, Mapping):
        return {k: gap[k] for k in names if k in gap}
    return {k: getattr(gap, k) for k in names if getattr(gap, k, None) is not None}
