"""Multi-turn agent sessions: an OpenAI chat-completions endpoint per session, with the
exact token ids of every turn kept ("token in, token out") and sticky placement.

Owns the session lifecycle (create, turn, status, trajectory, end) and one turn's path:
match the request's messages with the recorded turns (a mismatch is a 422 naming the first
differing message), tokenize only the new messages (`chat_template.py`), build the prompt
as the recorded ids plus those, choose the engine (`placement.py`: the session's own engine
while it can serve the turn), send SGLang's native `/generate` with token ids to the
engine agent (a 409/503 or a broken connection moves the turn to the next engine), record
the prompt ids, the sampled ids and their logprobs, the version span, engine and precision,
and answer an OpenAI chat.completion plus a `tether` object.

Never re-tokenizes recorded text: the engine's ids are the record. Reads the fleet only
from the snapshot; the database only through `SessionRecords` (in worker threads).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from typing import Any

import orjson

from controlplane.chat_template import (
    ChatTokenizer,
    TemplateError,
    Tokenizers,
    TokenizerUnavailable,
)
from controlplane.conversation import (
    InvalidMessage,
    canonical,
    canonical_all,
    first_difference,
    reply_message,
)
from controlplane.errors import (
    ApiError,
    InvalidRequest,
    NoEngineAvailable,
    SessionBusy,
    SessionGone,
    SessionHistoryMismatch,
    SessionUnknown,
)
from controlplane.placement import place
from controlplane.proxy import check_run, json_object, no_engine
from controlplane.refusals import too_far_ahead
from controlplane.services import Services
from controlplane.session_records import Session, SessionRecords, Turn
from controlplane.snapshot import EngineView
from http1.client import UpstreamError
from store.types import VersionConstraint
from wire import (
    SessionCreate,
    SessionInfo,
    SessionVersion,
    Trajectory,
    TurnInfo,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({409, 503})
# OpenAI body fields a session turn reads, and the SGLang sampling parameter each becomes.
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "sampling_seed",
    "stop": "stop",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
}
DEFAULT_MAX_TOKENS = 1024
SWEEP_EVERY_S = 60.0


def _int(value: Any, field: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidRequest(f"{field}: expected a non-negative integer", field=field)
    return value


class ChatSessions:
    """Agent sessions of one control-plane process (state lives in the database)."""

    def __init__(self, cp: Services) -> None:
        self.cp = cp
        self.records = SessionRecords(cp.sessions, cp.settings.session_cache)
        self.tokenizers = Tokenizers()
        self._busy: set[str] = set()
        # Sessions this process placed whose rows are not written yet: creations at the
        # same moment must see each other, or they would all pick the same engine.
        self._pending: Counter[str] = Counter()
        # A run's base checkpoint never changes, so neither does its tokenizer.
        self._by_run: dict[str, ChatTokenizer] = {}
        self._swept_at = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def create(self, body: SessionCreate, owner: str | None) -> SessionInfo:
        fleet = self.cp.fleet
        snap = fleet.snapshot
        await check_run(fleet, snap, body.run_id)
        run = await asyncio.to_thread(self.cp.runs.get, body.run_id)
        # A run without a tokenizer cannot hold sessions: say so now, not at the first turn.
        await self._tokenizer(run.run_id, run.base_checkpoint)
        version = body.version or SessionVersion(min=run.latest_version)
        constraint = version.constraint(run.latest_version)
        if not constraint.is_any:
            ahead = too_far_ahead(
                snap, run.run_id, constraint, self.cp.settings.max_versions_ahead, "body.version"
            )
            if ahead is not None:
                raise ahead
        if version.exact is not None:
            fleet.note_exact(run.run_id, version.exact)
        now = time.time()
        ttl = body.ttl_s or self.cp.settings.session_ttl_s
        session = Session(
            session_id=f"sess_{uuid.uuid4().hex}",
            run_id=run.run_id,
            owner=owner,
            engine_id=None,
            precision=None if body.precision is None else [p.value for p in body.precision],
            version=version.model_dump(exclude_none=True),
            labels=dict(body.labels),
            ttl_s=ttl,
            created_at=now,
            expires_at=now + ttl,
        )
        placed = Counter(await asyncio.to_thread(self.records.placed, run.run_id, now))
        engine = self._place(session, constraint, dict(placed + self._pending), set())
        session.engine_id = engine.engine_id if engine is not None else None
        if engine is not None:
            self._pending[engine.engine_id] += 1
        try:
            await asyncio.to_thread(self.records.create, session)
        finally:
            if engine is not None:
                self._pending[engine.engine_id] -= 1
        self.cp.metrics.sessions_created.inc()
        await self._sweep_now_and_then(now)
        return session.info()

    async def status(self, session_id: str, owner: str | None) -> SessionInfo:
        return (await self._session(session_id, owner)).info()

    async def trajectory(self, session_id: str, owner: str | None) -> Trajectory:
        session = await self._session(session_id, owner)
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int | None] = []
        for turn in session.turns:
            ids += turn.prompt_ids
            mask += [0] * len(turn.prompt_ids)
            logprobs += [0.0] * len(turn.prompt_ids)
            versions += [None] * len(turn.prompt_ids)
            ids += turn.completion_ids
            mask += [1] * len(turn.completion_ids)
            logprobs += turn.logprobs
            # One version for every token only when the turn ran on one version.
            one = turn.version_start if turn.version_start == turn.version_end else None
            versions += [one] * len(turn.completion_ids)
        return Trajectory(
            session_id=session.session_id,
            run_id=session.run_id,
            state=session.info().state,
            turns=session.records(),
            token_ids=ids,
            loss_mask=mask,
            logprobs=logprobs,
            token_versions=versions,
            prompt_length=len(session.turns[0].prompt_ids) if session.turns else 0,
        )

    async def end(self, session_id: str, owner: str | None) -> SessionInfo:
        session = await self._session(session_id, owner)
        await asyncio.to_thread(self.records.end, session, time.time())
        return session.info()

    # ------------------------------------------------------------------ one turn

    async def turn(self, session_id: str, raw: bytes, owner: str | None) -> dict[str, Any]:
        body = self._body(raw)
        session = await self._session(session_id, owner)
        if session.ended_at is not None:
            raise SessionGone(
                f"session {session_id!r} was ended: its trajectory stays readable until "
                "it expires; create a new session for a new episode"
            )
        if session_id in self._busy:
            raise SessionBusy(
                f"session {session_id!r} is answering another turn: send a session's turns "
                "one at a time"
            )
        self._busy.add(session_id)
        try:
            return await self._turn(session, body)
        finally:
            self._busy.discard(session_id)

    async def _turn(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        try:
            sent = canonical_all(body.get("messages"))
        except InvalidMessage as exc:
            raise InvalidRequest(str(exc), field=exc.field) from exc
        recorded = session.history()
        differs = first_difference(recorded, sent)
        if differs is not None:
            index, what = differs
            field = f"body.messages[{index}]"
            raise SessionHistoryMismatch(
                f"{field} {what}; a session's request repeats its recorded turns exactly "
                "(the replies as answered) and adds new messages after them",
                field=field,
            )
        new = body["messages"][len(recorded) :]
        if not new:
            raise InvalidRequest(
                f"body.messages: no new message after the {len(recorded)} recorded ones; "
                "append the next user or tool message",
                field="body.messages",
            )
        tools = body.get("tools") or None
        tokenizer = self._by_run.get(session.run_id)
        if tokenizer is None:
            run = await asyncio.to_thread(self.cp.runs.get, session.run_id)
            tokenizer = await self._tokenizer(run.run_id, run.base_checkpoint)
        history_sent = body["messages"][: len(recorded)]
        previous = session.token_ids()
        try:
            if session.turns:
                last = session.turns[-1].completion_ids
                added = await asyncio.to_thread(
                    tokenizer.continuation, history_sent, new, tools, last
                )
            else:
                added = await asyncio.to_thread(tokenizer.first_prompt, new, tools)
        except TemplateError as exc:
            raise InvalidRequest(
                f"body.messages: the run's chat template refused the messages: {exc}",
                field="body.messages",
            ) from exc
        prompt = previous + added
        sampling = self._sampling(body)
        home = session.engine_id
        answer, engine, moved = await self._generate(session, prompt, sampling)
        completion, logprobs, start, end, finish = self._read(answer)
        cached = (answer.get("meta_info") or {}).get("cached_tokens")
        text = tokenizer.decode(completion)
        reply, calls = reply_message(text, bool(tools))
        reason = "tool_calls" if calls else ("length" if finish == "length" else "stop")
        turn = Turn(
            turn=len(session.turns),
            messages=[
                canonical(m, f"body.messages[{len(recorded) + i}]") for i, m in enumerate(new)
            ],
            reply=canonical(reply, "reply"),
            prompt_ids=added,
            completion_ids=completion,
            logprobs=logprobs,
            version_start=start,
            version_end=end,
            engine_id=engine.engine_id,
            precision=engine.precision.value,
            finish_reason=finish,
            created_at=time.time(),
        )
        await asyncio.to_thread(self.records.append, session, turn)
        placement = "moved" if moved else ("placed" if home is None else "stayed")
        self.cp.metrics.session_turns.labels(placement).inc()
        info = TurnInfo(
            session_id=session.session_id,
            turn=turn.turn,
            engine_id=engine.engine_id,
            precision=engine.precision,
            weight_version_start=start,
            weight_version_end=end,
            prompt_tokens=len(prompt),
            new_prompt_tokens=len(added),
            completion_tokens=len(completion),
            cached_tokens=cached if isinstance(cached, int) else None,
            moved=moved,
        )
        choice: dict[str, Any] = {"index": 0, "message": reply, "finish_reason": reason}
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": (piece := tokenizer.token_text(tid)),
                        "logprob": lp,
                        "bytes": list(piece.encode()),
                        "top_logprobs": [],
                    }
                    for tid, lp in zip(completion, logprobs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or session.run_id,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion),
                "total_tokens": len(prompt) + len(completion),
            },
            "tether": info.model_dump(mode="json"),
        }

    # ------------------------------------------------------------------ parts

    @staticmethod
    def _body(raw: bytes) -> dict[str, Any]:
        body = json_object(raw)
        if body.get("stream"):
            raise InvalidRequest(
                "body.stream: session turns answer whole completions; drop stream",
                field="body.stream",
            )
        if body.get("n", 1) != 1:
            raise InvalidRequest(
                "body.n: a session holds one conversation, so n must be 1; open one session "
                "per sample",
                field="body.n",
            )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest("body.tools: expected a list of tools", field="body.tools")
        return body

    @staticmethod
    def _sampling(body: dict[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        params["max_new_tokens"] = (
            DEFAULT_MAX_TOKENS if limit is None else _int(limit, "body.max_tokens")
        )
        for name, ours in SAMPLING.items():
            if body.get(name) is not None:
                params[ours] = body[name]
        # The reply's text is decoded here from the ids; the engine's text is not used.
        params["skip_special_tokens"] = False
        return params

    async def _session(self, session_id: str, owner: str | None) -> Session:
        session = await asyncio.to_thread(self.records.get, session_id)
        # Another caller's session is as unknown as a missing one (ids are not secrets to
        # enumerate, but trajectories are the creator's).
        if session is None or (owner is not None and session.owner not in (None, owner)):
            raise SessionUnknown(
                f"session {session_id!r} does not exist (or was swept after expiring): "
                "create one with POST /v1/sessions"
            )
        if session.expires_at <= time.time():
            raise SessionGone(
                f"session {session_id!r} expired at {session.expires_at:.0f} (its ttl_s is "
                f"{session.ttl_s:.0f} s after the last turn): create a new session"
            )
        return session

    async def _tokenizer(self, run_id: str, source: str | None) -> ChatTokenizer:
        try:
            found = await asyncio.to_thread(self.tokenizers.get, source, run_id)
        except TokenizerUnavailable as exc:
            raise InvalidRequest(str(exc), field="run_id") from exc
        self._by_run[run_id] = found
        return found

    def _constraint(self, session: Session) -> VersionConstraint:
        run = self.cp.fleet.snapshot.runs.get(session.run_id)
        latest = run.latest_version if run is not None else None
        return SessionVersion.model_validate(session.version).constraint(latest)

    def _place(
        self,
        session: Session,
        constraint: VersionConstraint,
        placed: dict[str, int],
        exclude: set[str],
    ) -> EngineView | None:
        fleet = self.cp.fleet
        return place(
            fleet.snapshot,
            session.run_id,
            constraint,
            current=session.engine_id,
            precisions=session.precisions(),
            placed=placed,
            local_in_flight=fleet.in_flight,
            exclude=exclude,
            now=fleet.lease_clock(),
        )

    async def _generate(
        self, session: Session, prompt: list[int], sampling: dict[str, Any]
    ) -> tuple[dict[str, Any], EngineView, bool]:
        """The engine's answer for `prompt`, the engine that gave it, and whether the
        session moved to it."""
        assert self.cp.proxy is not None
        client = self.cp.proxy.client
        constraint = self._constraint(session)
        if constraint.exact_version is not None:
            self.cp.fleet.note_exact(session.run_id, constraint.exact_version)
        weight_version = {
            "min_version": constraint.min_version,
            "exact_version": constraint.exact_version,
        }
        body = orjson.dumps(
            {
                "input_ids": prompt,
                "sampling_params": sampling,
                "return_logprob": True,
                "weight_version": weight_version,
                "run_id": session.run_id,
            }
        )
        in_flight = self.cp.fleet.in_flight
        tried: set[str] = set()
        placed: dict[str, int] | None = None
        saw_not_ready = False
        for _ in range(max(self.cp.settings.route_attempts, 2)):
            engine = self._place(session, constraint, placed or {}, tried)
            if engine is not None and engine.engine_id != session.engine_id and placed is None:
                # Moving: weigh the other engines by the sessions they hold.
                placed = await asyncio.to_thread(self.records.placed, session.run_id, time.time())
                engine = self._place(session, constraint, placed, tried)
            if engine is None:
                break
            tried.add(engine.engine_id)
            in_flight[engine.engine_id] += 1
            try:
                answer = await client.post(engine.url, "/generate", body)
            except UpstreamError as exc:
                log.warning(
                    "session %s: engine %s at %s failed: %s",
                    session.session_id,
                    engine.engine_id,
                    engine.url,
                    exc,
                )
                continue
            finally:
                in_flight[engine.engine_id] -= 1
            if answer.status in RETRY_STATUSES:
                saw_not_ready = saw_not_ready or answer.status == 409
                continue
            if answer.status != 200:
                raise self._engine_refused(engine, answer.status, answer.body)
            try:
                parsed = orjson.loads(answer.body)
            except orjson.JSONDecodeError:
                log.warning("session %s: engine %s answered no JSON", session.session_id, engine)
                continue
            if not isinstance(parsed, dict):
                continue
            moved = session.engine_id is not None and engine.engine_id != session.engine_id
            if moved:
                log.info(
                    "session %s moved from engine %s to %s",
                    session.session_id,
                    session.engine_id,
                    engine.engine_id,
                )
            return parsed, engine, moved
        if tried and not saw_not_ready:
            raise NoEngineAvailable(
                f"{len(tried)} eligible engine(s) of run {session.run_id!r} failed to answer "
                "the session's turn; retry",
                tried=sorted(tried),
            )
        raise no_engine(
            self.cp.fleet.snapshot,
            session.run_id,
            constraint,
            session.precisions(),
            self.cp.settings.default_retry_after_s,
            "engines_refused" if tried else "none_eligible",
        )

    @staticmethod
    def _engine_refused(engine: EngineView, status: int, raw: bytes) -> ApiError:
        try:
            detail = orjson.loads(raw)
        except orjson.JSONDecodeError:
            detail = raw[:500].decode("utf-8", "replace")
        message = detail
        if isinstance(detail, dict):
            error = detail.get("error", detail)
            message = error.get("message", error) if isinstance(error, dict) else error
        error = InvalidRequest(
            f"engine {engine.engine_id} refused the turn ({status}): {message}",
            field="body",
            engine_id=engine.engine_id,
        )
        if status < 500:
            return error
        error.status = 502
        return error

    @staticmethod
    def _read(
        payload: dict[str, Any],
    ) -> tuple[list[int], list[float], int | None, int | None, str | None]:
        """The sampled ids, their logprobs, the version span and the finish reason."""
        meta = payload.get("meta_info") or {}
        ids = payload.get("output_ids")
        pairs = meta.get("output_token_logprobs")
        if not isinstance(ids, list) or not isinstance(pairs, list) or len(ids) != len(pairs):
            raise NoEngineAvailable(
                "the engine's answer lacks output_ids with one logprob each; the engine "
                "agent in between does not speak SGLang's /generate",
            )
        logprobs = [float(p[0]) if p and p[0] is not None else 0.0 for p in pairs]
        # The sampler's own ids: a logprob entry naming another id is a broken record.
        for i, (tid, pair) in enumerate(zip(ids, pairs, strict=True)):
            if len(pair) > 1 and pair[1] is not None and pair[1] != tid:
                raise NoEngineAvailable(
                    f"the engine's logprob {i} is for token {pair[1]}, its output id is {tid}"
                )
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        start, end = payload.get("weight_version_start"), payload.get("weight_version_end")
        return (
            [int(t) for t in ids],
            logprobs,
            start if isinstance(start, int) else None,
            end if isinstance(end, int) else None,
            reason if isinstance(reason, str) else None,
        )

    async def _sweep_now_and_then(self, now: float) -> None:
        if now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        gone = await asyncio.to_thread(self.records.sweep, now)
        if gone:
            log.info("swept %d expired agent sessions", gone)
