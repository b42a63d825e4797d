"""Chat messages in agent sessions: their canonical form, matching a request's history with
the recorded turns, and the assistant reply built from the sampled text.

Owns what counts as "the same message" (role, text content, tool calls by name and
arguments, tool-call id and name; client-side extras such as `refusal: null` or a
regenerated tool-call id do not matter), `first_difference`, and the reply: the decoded
completion with Hermes-style `<tool_call>{...}</tool_call>` blocks (the format of Qwen and
Hermes chat templates) turned into OpenAI `tool_calls` when the request offered tools.
Pure functions over JSON values; never tokenizes and never touches the database.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class InvalidMessage(ValueError):
    """A message the session cannot use; `field` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _text(content: Any, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                raise InvalidMessage(
                    f"{field}[{i}]: only text content parts are supported in sessions",
                    f"{field}[{i}]",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidMessage(f"{field}: expected a string, a list of text parts or null", field)


def _arguments(value: Any) -> Any:
    """Tool-call arguments compared as JSON values when they parse, else as text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def canonical(message: Any, field: str) -> dict[str, Any]:
    """The parts of a message that shape the prompt, in one stable form."""
    if not isinstance(message, dict):
        raise InvalidMessage(f"{field}: expected a message object", field)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidMessage(
            f"{field}.role: expected one of {', '.join(sorted(ROLES))}, got {role!r}",
            f"{field}.role",
        )
    content = _text(message.get("content"), f"{field}.content")
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise InvalidMessage(f"{field}.tool_calls: expected a list", f"{field}.tool_calls")
        out["tool_calls"] = []
        for i, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                where = f"{field}.tool_calls[{i}].function"
                raise InvalidMessage(f"{where}: expected {{name, arguments}}", where)
            out["tool_calls"].append(
                {"name": function["name"], "arguments": _arguments(function.get("arguments"))}
            )
    return out


def canonical_all(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidMessage(
            "body.messages: expected a non-empty list of messages", "body.messages"
        )
    return [canonical(m, f"body.messages[{i}]") for i, m in enumerate(messages)]


def _clip(text: Any, size: int = 80) -> str:
    shown = json.dumps(text, ensure_ascii=False)
    return shown if len(shown) <= size else shown[: size - 1] + "…"


def first_difference(
    recorded: Sequence[Mapping[str, Any]], sent: Sequence[Mapping[str, Any]]
) -> tuple[int, str] | None:
    """Where `sent` stops repeating `recorded`: (index, what differs), or None if it
    repeats all of it."""
    for i, want in enumerate(recorded):
        if i >= len(sent):
            return i, f"is missing (the session has {len(recorded)} recorded messages)"
        got = sent[i]
        if got == want:
            continue
        for key in ("role", "content", "tool_calls", "tool_call_id", "name"):
            if got.get(key) != want.get(key):
                return i, (
                    f"differs in {key!r}: the session recorded {_clip(want.get(key))}, "
                    f"the request has {_clip(got.get(key))}"
                )
        return i, "differs from the recorded message"
    return None


def reply_message(text: str, tools_offered: bool) -> tuple[dict[str, Any], bool]:
    """The OpenAI assistant message for the sampled text, and whether it calls tools."""
    calls: list[dict[str, Any]] = []
    if tools_offered:
        for match in TOOL_CALL.finditer(text):
            try:
                parsed = json.loads(match.group(1))
            except ValueError:
                continue  # not a well-formed call: it stays in the content as text
            if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                continue
            arguments = parsed.get("arguments", {})
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": parsed["name"],
                        "arguments": arguments
                        if isinstance(arguments, str)
                        else json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
    if not calls:
        return {"role": "assistant", "content": text}, False
    content = TOOL_CALL.sub("", text).strip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, True
