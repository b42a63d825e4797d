"""Agent sessions through a real fleet: a control plane on PostgreSQL, two BF16 reference
engines behind their engine agents (see `conftest.py`).

Tests run in file order on one fleet: the last ones restart the control plane and stop an
agent.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from tests.fixtures.processes import wait_until
from tests.sessions.conftest import DEADLINE_S, RUN, SessionFleet

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


def _assert_exact_continuity(trajectory: dict[str, Any]) -> None:
    """Each turn's prompt starts with the previous turn's prompt and completion, id for id,
    and the whole sequence is the last prompt plus its completion."""
    turns = trajectory["turns"]
    for before, after in itertools.pairwise(turns):
        carried = before["prompt_ids"] + before["completion_ids"]
        assert after["prompt_ids"][: len(carried)] == carried
        assert len(after["prompt_ids"]) > len(carried)
    last = turns[-1]
    assert trajectory["token_ids"] == last["prompt_ids"] + last["completion_ids"]


def test_a_multi_turn_conversation_with_tool_calls_keeps_every_turns_exact_ids(
    fleet: SessionFleet,
) -> None:
    session = fleet.create(labels={"task": "add"})
    sid = session["session_id"]
    assert session["engine_id"] is not None and session["turns"] == 0
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "what is the sum of 12 and 7"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 12, "b": 7}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "19"},
    ]
    answers = []
    for step in range(3):
        answer = fleet.chat(sid, messages, tools=TOOLS, logprobs=True, temperature=1.0, seed=step)
        answers.append(answer)
        reply = answer["choices"][0]["message"]
        assert reply["role"] == "assistant"
        messages.append(reply)
        messages.append({"role": "tool", "tool_call_id": f"call_{step + 1}", "content": "19"})
        messages.append({"role": "user", "content": "and the sum of 3 and 4"})

    trajectory = fleet.trajectory(sid)
    assert [t["turn"] for t in trajectory["turns"]] == [0, 1, 2]
    _assert_exact_continuity(trajectory)
    for answer, turn in zip(answers, trajectory["turns"], strict=True):
        tether = answer["tether"]
        assert tether["turn"] == turn["turn"]
        assert tether["engine_id"] == turn["engine_id"] == session["engine_id"]
        assert tether["prompt_tokens"] == len(turn["prompt_ids"])
        assert tether["completion_tokens"] == len(turn["completion_ids"])
        assert turn["weight_version_start"] == turn["weight_version_end"] == 0
        assert turn["precision"] == "bf16"
        # The answer's logprobs are the record's, one per sampled id.
        sampled = [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
        assert sampled == turn["logprobs"]
        assert len(turn["logprobs"]) == len(turn["completion_ids"]) > 0
    # The loss mask covers exactly the sampled ids; logprobs sit on them.
    mask, logprobs = trajectory["loss_mask"], trajectory["logprobs"]
    assert len(mask) == len(logprobs) == len(trajectory["token_ids"])
    assert sum(mask) == sum(len(t["completion_ids"]) for t in trajectory["turns"])
    assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == [
        lp for t in trajectory["turns"] for lp in t["logprobs"]
    ]
    assert trajectory["prompt_length"] == len(trajectory["turns"][0]["prompt_ids"])
    assert set(trajectory["token_versions"][trajectory["prompt_length"] :]) <= {0, None}


def test_the_openai_sdk_holds_a_conversation_through_a_session(fleet: SessionFleet) -> None:
    from openai import OpenAI

    sid = fleet.create()["session_id"]
    llm = OpenAI(
        base_url=f"{fleet.cp.url}/v1/sessions/{sid}",
        api_key=fleet.cp.tokens["client"],
        max_retries=5,  # the SDK retries 409/503 after Retry-After, as a session turn wants
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 3 plus 4"}]
    for turn in range(2):
        answer = llm.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            tools=TOOLS,
            seed=turn,  # type: ignore[arg-type]
        )
        assert answer.model_extra is not None
        assert answer.model_extra["tether"]["turn"] == turn
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        messages.append(answer.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "and 1"})
    trajectory = fleet.trajectory(sid)
    assert len(trajectory["turns"]) == 2
    _assert_exact_continuity(trajectory)


def test_retokenizing_the_conversation_text_gives_other_ids_than_the_sessions_record(
    fleet: SessionFleet,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(fleet.model))
    sid = fleet.create()["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 12 plus 7"}]
    for seed in range(4):
        answer = fleet.chat(sid, messages, temperature=1.0, seed=seed, max_tokens=12)
        messages.append(answer["choices"][0]["message"])
        messages.append({"role": "user", "content": "and 3"})
    trajectory = fleet.trajectory(sid)
    _assert_exact_continuity(trajectory)

    # What a trainer would get by tokenizing the finished conversation's text...
    conversation = messages[:-1]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    retokenized = tokenizer.encode(text, add_special_tokens=False)
    # ...is not what the engine sampled: the sampled ids of some reply are not the
    # tokenizer's own reading of their text (e.g. "1" "2" sampled, "12" re-read).
    drifted = [
        t["turn"]
        for t in trajectory["turns"]
        if tokenizer.encode(
            tokenizer.decode(t["completion_ids"], skip_special_tokens=False),
            add_special_tokens=False,
        )
        != t["completion_ids"]
    ]
    assert drifted, "every sampled reply happened to be canonically tokenized"
    record = trajectory["token_ids"]
    assert retokenized[: len(record)] != record
    # The record is the engine's: every turn's prompt carries the sampled ids unchanged.
    for before, after in itertools.pairwise(trajectory["turns"]):
        assert (
            before["completion_ids"]
            == after["prompt_ids"][
                len(before["prompt_ids"]) : len(before["prompt_ids"])
                + len(before["completion_ids"])
            ]
        )


def test_a_request_that_does_not_repeat_the_recorded_turns_is_refused_naming_the_message(
    fleet: SessionFleet,
) -> None:
    sid = fleet.create()["session_id"]
    first = [{"role": "user", "content": "what is 2 plus 2"}]
    reply = fleet.chat(sid, first)["choices"][0]["message"]
    follow = {"role": "user", "content": "and 3"}

    edited = {**reply, "content": (reply["content"] or "") + "!"}
    refused = fleet.turn(sid, [*first, edited, follow])
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["type"] == "SessionHistoryMismatch"
    assert error["field"] == "body.messages[1]"
    assert "content" in error["message"]

    refused = fleet.turn(sid, [{"role": "user", "content": "what is 2 plus 3"}, reply, follow])
    assert refused.status_code == 422
    assert refused.json()["error"]["field"] == "body.messages[0]"

    refused = fleet.turn(sid, [*first, reply])
    assert refused.status_code == 422
    assert "no new message" in refused.json()["error"]["message"]

    for extra, field in (({"stream": True}, "body.stream"), ({"n": 2}, "body.n")):
        refused = fleet.turn(sid, [*first, reply, follow], **extra)
        assert refused.status_code == 422
        assert refused.json()["error"]["field"] == field

    # Nothing refused was recorded: the conversation goes on from turn 1.
    answer = fleet.chat(sid, [*first, reply, follow])
    assert answer["tether"]["turn"] == 1


def test_unknown_ended_and_other_callers_sessions_are_refused(fleet: SessionFleet) -> None:
    unknown = fleet.turn("sess_0123", [{"role": "user", "content": "hi"}])
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "SessionUnknown"

    sid = fleet.create()["session_id"]
    messages = [{"role": "user", "content": "hi"}]
    reply = fleet.chat(sid, messages)["choices"][0]["message"]

    # A session belongs to the token that created it.
    other = fleet.call("POST", "/v1/tokens", "admin", json={"role": "client", "name": "other"})
    fleet.cp.tokens["other"] = other.json()["token"]
    assert fleet.call("GET", f"/v1/sessions/{sid}", "other").status_code == 404
    assert fleet.call("GET", f"/v1/sessions/{sid}", "admin").status_code == 200
    # A viewer may not create (or read) sessions.
    viewer = fleet.call("POST", "/v1/sessions", "viewer", json={"run_id": RUN})
    assert viewer.status_code == 403

    ended = fleet.call("DELETE", f"/v1/sessions/{sid}")
    assert ended.status_code == 200 and ended.json()["state"] == "ended"
    refused = fleet.turn(sid, [*messages, reply, {"role": "user", "content": "and"}])
    assert refused.status_code == 410
    assert refused.json()["error"]["type"] == "SessionGone"
    # The trajectory stays readable until the session expires.
    assert len(fleet.trajectory(sid)["turns"]) == 1


def test_an_expired_session_is_gone(fleet: SessionFleet) -> None:
    sid = fleet.create(ttl_s=0.5)["session_id"]

    def gone() -> bool:
        return fleet.call("GET", f"/v1/sessions/{sid}").status_code == 410

    wait_until(gone, 30.0, "the session to expire")
    refused = fleet.turn(sid, [{"role": "user", "content": "hi"}])
    assert refused.status_code == 410


def test_new_sessions_spread_over_the_least_loaded_engines_and_stay_there(
    fleet: SessionFleet,
) -> None:
    sessions = [fleet.create() for _ in range(4)]
    placed: dict[str, int] = {}
    for session in sessions:
        placed[session["engine_id"]] = placed.get(session["engine_id"], 0) + 1
    # Both engines get new sessions (neither takes all four).
    assert len(placed) == 2, placed
    for session in sessions:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 1 plus 1"}]
        for _ in range(2):
            answer = fleet.chat(session["session_id"], messages)
            assert answer["tether"]["engine_id"] == session["engine_id"]
            assert answer["tether"]["moved"] is False
            messages += [answer["choices"][0]["message"], {"role": "user", "content": "ok"}]


def test_a_pinned_session_keeps_its_version_while_the_fleet_moves_on(
    fleet: SessionFleet,
) -> None:
    policy = {"kind": "keep_pinned", "engines": 1, "window_s": 60, "max_lag": 16}
    reply = fleet.call("PUT", f"/v1/runs/{RUN}/policy", "trainer", json=policy)
    assert reply.status_code == 200, reply.text
    pinned = fleet.create(version={"exact": 0})
    assert pinned["version"] == {"exact": 0}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 5 plus 5"}]
    answer = fleet.chat(pinned["session_id"], messages)
    assert answer["tether"]["weight_version_start"] == 0

    version = fleet.chain.publish("delta")
    fleet.cp.notify(RUN, version)
    fleet.wait_engines(1, version)

    fresh = fleet.create()
    assert fresh["version"] == {"min": version}
    later = fleet.chat(fresh["session_id"], [{"role": "user", "content": "hi"}])
    assert later["tether"]["weight_version_start"] == version

    messages += [answer["choices"][0]["message"], {"role": "user", "content": "and 1"}]
    again = fleet.chat(pinned["session_id"], messages)
    assert again["tether"]["weight_version_start"] == again["tether"]["weight_version_end"] == 0
    assert fleet.trajectory(pinned["session_id"])["token_versions"][-1] == 0

    reply = fleet.call("PUT", f"/v1/runs/{RUN}/policy", "trainer", json={"kind": "follow_latest"})
    assert reply.status_code == 200, reply.text
    fleet.wait_engines(2, version)


def test_sessions_and_their_records_survive_a_control_plane_restart_on_postgresql(
    fleet: SessionFleet,
) -> None:
    session = fleet.create()
    sid = session["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 4 plus 4"}]
    answer = fleet.chat(sid, messages)
    before = fleet.trajectory(sid)

    fleet.restart_controlplane()

    after = fleet.trajectory(sid)
    assert after["turns"] == before["turns"]
    messages += [answer["choices"][0]["message"], {"role": "user", "content": "ok"}]
    fleet.wait_engines(2)
    follow = fleet.chat(sid, messages)
    assert follow["tether"]["turn"] == 1
    _assert_exact_continuity(fleet.trajectory(sid))


def test_a_session_moves_to_another_engine_only_when_its_engine_fails(
    fleet: SessionFleet,
) -> None:
    session = fleet.create()
    sid = session["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 6 plus 1"}]
    answer = fleet.chat(sid, messages)
    home = answer["tether"]["engine_id"]
    # The listing holds only engines whose lease is current; on a loaded machine a heartbeat
    # can come later than the 5 s lease, so the home engine is looked up until it is listed.
    url = wait_until(
        lambda: {i: u for u, i in fleet.engine_ids().items()}.get(home),
        DEADLINE_S,
        f"engine {home} listed with a current lease",
    )
    failing = next(a for a in fleet.agents if a.url == url)
    # Killed: still leased and registered, but nobody answers at its URL any more.
    failing.kill()

    messages += [answer["choices"][0]["message"], {"role": "user", "content": "ok"}]
    moved = fleet.chat(sid, messages)
    assert moved["tether"]["moved"] is True
    assert moved["tether"]["engine_id"] != home
    trajectory = fleet.trajectory(sid)
    _assert_exact_continuity(trajectory)
    assert (
        fleet.call("GET", f"/v1/sessions/{sid}").json()["engine_id"] == moved["tether"]["engine_id"]
    )
    metrics = fleet.call("GET", "/metrics").text
    moves = re.search(r'^tether_session_turns_total\{placement="moved"\} (\S+)$', metrics, re.M)
    assert moves is not None and float(moves.group(1)) >= 1
