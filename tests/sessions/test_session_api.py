"""Agent sessions without engines: the control plane in process on SQLite (creation,
validation, auth, expiry), the records on SQLite, and the pure parts (template pieces,
message matching, tool-call replies)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.controlplane.conftest import Api, make_api, sqlite_url  # noqa: F401
from tests.fixtures.processes import wait_until
from tests.fixtures.reference_engine import TinyCheckpoints

RUN = "s-run"


@pytest.fixture
def api(make_api: Any, sqlite_url: str, tiny: TinyCheckpoints) -> Api:  # noqa: F811
    built: Api = make_api(sqlite_url)
    built.create_run(RUN, base_checkpoint=str(tiny.bf16))
    return built


def _create(api: Api, role: str = "client", **body: Any) -> Any:
    return api.call("POST", "/v1/sessions", role, json={"run_id": RUN, **body})


def test_only_client_and_trainer_tokens_may_open_sessions(api: Api) -> None:
    assert _create(api, "viewer").status_code == 403
    assert _create(api, "engine").status_code == 403
    assert api.client.post("/v1/sessions", json={"run_id": RUN}).status_code == 401
    for role in ("client", "trainer", "admin"):
        reply = _create(api, role)
        assert reply.status_code == 201, reply.text


def test_a_session_without_engines_is_created_and_its_turn_is_a_retryable_409(api: Api) -> None:
    api.publish(RUN, 0)
    reply = _create(api, precision=["bf16"], labels={"task": "t1"}, ttl_s=60)
    assert reply.status_code == 201, reply.text
    info = reply.json()
    assert info["engine_id"] is None
    assert info["version"] == {"min": 0}
    assert info["labels"] == {"task": "t1"} and info["precision"] == ["bf16"]
    assert info["expires_at"] == pytest.approx(info["created_at"] + 60)
    sid = info["session_id"]
    body = {"messages": [{"role": "user", "content": "hi"}]}
    turn = api.call("POST", f"/v1/sessions/{sid}/chat/completions", "client", json=body)
    assert turn.status_code == 409, turn.text
    assert turn.json()["error"]["retryable"] is True
    # Nothing was recorded.
    trajectory = api.call("GET", f"/v1/sessions/{sid}/trajectory", "client").json()
    assert trajectory["turns"] == [] and trajectory["token_ids"] == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"version": {"exact": 1, "min": 0}}, "body.version"),
        ({"version": {"max_lag": -1}}, "body.version.max_lag"),
        ({"precision": []}, "body.precision"),
        ({"ttl_s": 0}, "body.ttl_s"),
        ({"labels": {"": "x"}}, "body.labels"),
        ({"surprise": 1}, "body.surprise"),
    ],
)
def test_a_bad_create_body_names_the_field(api: Api, body: dict, field: str) -> None:
    reply = _create(api, **body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == field


def test_a_run_that_is_unknown_or_has_no_tokenizer_cannot_hold_sessions(api: Api) -> None:
    reply = api.call("POST", "/v1/sessions", "client", json={"run_id": "nope"})
    assert reply.status_code == 404
    api.create_run("bare")
    reply = api.call("POST", "/v1/sessions", "client", json={"run_id": "bare"})
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["field"] == "run_id" and "base_checkpoint" in error["message"]


def test_unknown_sessions_are_404_on_every_route(api: Api) -> None:
    for method, path in (
        ("GET", "/v1/sessions/sess_x"),
        ("GET", "/v1/sessions/sess_x/trajectory"),
        ("DELETE", "/v1/sessions/sess_x"),
        ("POST", "/v1/sessions/sess_x/chat/completions"),
    ):
        reply = api.call(method, path, "client", json={"messages": [{"role": "user"}]})
        assert reply.status_code == 404, (method, path, reply.text)
        assert reply.json()["error"]["type"] == "SessionUnknown"


def test_sessions_expire_after_their_ttl_and_are_swept(api: Api) -> None:
    info = _create(api, ttl_s=0.3).json()
    sid = info["session_id"]
    assert info["expires_at"] == pytest.approx(info["created_at"] + 0.3)
    wait_until(
        lambda: api.call("GET", f"/v1/sessions/{sid}", "client").status_code == 410,
        10.0,
        "the session to expire",
    )
    records = api.client.app.state.chat_sessions.records
    assert records.sweep() >= 1
    assert api.call("GET", f"/v1/sessions/{sid}", "client").status_code == 404


# ---------------------------------------------------------------- records


def _turn(index: int, ids: list[int]) -> Any:
    from controlplane.session_records import Turn

    return Turn(
        turn=index,
        messages=[{"role": "user", "content": "hi"}],
        reply={"role": "assistant", "content": "ok"},
        prompt_ids=ids,
        completion_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        version_start=3,
        version_end=3,
        engine_id="e1",
        precision="bf16",
        finish_reason="stop",
        created_at=time.time(),
    )


def test_records_append_turns_in_order_and_refuse_a_turn_recorded_twice(tmp_path: Path) -> None:
    from controlplane.db import migrate, open_engine, session_factory
    from controlplane.errors import SessionBusy
    from controlplane.session_records import Session, SessionRecords

    url = f"sqlite:///{tmp_path / 'cp.db'}"
    migrate(url)
    engine = open_engine(url)
    try:
        records = SessionRecords(session_factory(engine), capacity=1)
        now = time.time()
        session = Session("s1", RUN, None, None, None, {"min": 0}, {}, 60.0, now, now + 60)
        records.create(session)
        records.create(Session("s2", RUN, None, "e1", None, {}, {}, 60.0, now, now + 60))
        records.append(session, _turn(0, [1, 2, 3]))
        stale = records.get("s1")
        assert stale is not None and stale.token_ids() == [1, 2, 3, 7, 8]
        records.append(session, _turn(1, [4]))
        # A copy that missed turn 1 may not record its own turn 1.
        stale.turns = stale.turns[:1]
        with pytest.raises(SessionBusy):
            records.append(stale, _turn(1, [5]))
        fresh = records.get("s1")
        assert fresh is not None
        assert fresh.token_ids() == [1, 2, 3, 7, 8, 4, 7, 8]
        assert [r.prompt_ids for r in fresh.records()] == [[1, 2, 3], [1, 2, 3, 7, 8, 4]]
        assert records.placed(RUN, time.time()) == {"e1": 2}
        assert records.sweep(now + 3600) == 2
        assert records.get("s1") is None
    finally:
        engine.dispose()


# ---------------------------------------------------------------- pure parts


def test_the_template_pieces_of_the_tiny_model(tiny: TinyCheckpoints) -> None:
    from controlplane.chat_template import ChatTokenizer

    tok = ChatTokenizer.load(str(tiny.bf16))
    assert tok.end_of_turn() == "<|im_end|>\n"
    eos = tok.tokenizer.token_to_id("<|im_end|>")
    # After a sampled end-of-turn token only the newline is missing; after a cut-off reply
    # the whole end of turn is.
    assert tok.bridge([5, eos]) == "\n"
    assert tok.bridge([5, 6]) == "<|im_end|>\n"
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    new = [{"role": "tool", "content": "19"}]
    text = tok.new_messages_text(history, new, None)
    assert text == "<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n"


def test_history_matching_names_the_first_differing_message() -> None:
    from controlplane.conversation import canonical_all, first_difference

    recorded = canonical_all(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}],
            },
        ]
    )
    # A client's copy with extras, another call id and re-serialised arguments matches.
    sent = canonical_all(
        [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": "",
                "refusal": None,
                "tool_calls": [
                    {"id": "x", "type": "function",
                     "function": {"name": "add", "arguments": '{ "a":1 }'}}
                ],
            },
        ]
    )  # fmt: skip
    assert first_difference(recorded, sent) is None
    changed = canonical_all([{"role": "user", "content": "hi"}, {"role": "assistant"}])
    index, what = first_difference(recorded, changed) or (None, "")
    assert index == 1 and "tool_calls" in what
    missing = first_difference(recorded, sent[:1])
    assert missing == (1, "is missing (the session has 2 recorded messages)")


def test_a_reply_with_hermes_tool_call_blocks_becomes_openai_tool_calls() -> None:
    from controlplane.conversation import reply_message

    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    message, calls = reply_message(text, tools_offered=True)
    assert calls
    assert message["content"] == "Let me add."
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert call["function"]["arguments"] == '{"a": 1, "b": 2}'
    plain, calls = reply_message(text, tools_offered=False)
    assert not calls and plain == {"role": "assistant", "content": text}


def test_turns_on_sqlite_keep_exact_ids_and_outlive_the_app(
    make_api: Any,  # noqa: F811
    sqlite_url: str,  # noqa: F811
    tiny: TinyCheckpoints,
    bf16_engine: Any,
) -> None:
    # The bare reference engine stands in for an agent (it ignores the routing fields).
    first: Api = make_api(sqlite_url)
    first.create_run(RUN, base_checkpoint=str(tiny.bf16))
    first.publish(RUN, 0)
    engine_id = first.register(RUN, 0, url=bf16_engine.url)
    first.settle()
    sid = _create(first).json()["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 2 plus 5"}]
    for turn in range(2):
        body = {"messages": messages, "max_tokens": 5, "seed": turn}
        reply = first.call("POST", f"/v1/sessions/{sid}/chat/completions", "client", json=body)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["tether"]["engine_id"] == engine_id
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "ok"}]
    before = first.call("GET", f"/v1/sessions/{sid}/trajectory", "client").json()
    one, two = before["turns"]
    assert two["prompt_ids"][: len(one["prompt_ids"]) + len(one["completion_ids"])] == (
        one["prompt_ids"] + one["completion_ids"]
    )
    # Another process on the same database file reads the same record.
    second: Api = make_api(sqlite_url)
    after = second.call("GET", f"/v1/sessions/{sid}/trajectory", "admin")
    assert after.status_code == 200
    assert after.json()["turns"] == before["turns"]
