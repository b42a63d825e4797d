"""A run's tokenizer and chat template, as agent sessions use them: only new messages are
ever tokenized.

Owns `ChatTokenizer`: the first turn's prompt (the template applied to the messages, with
the generation prompt), each later turn's added ids (what the template renders for the new
messages after the conversation so far, plus the template's end-of-turn text the model did
not sample), decoding, and the per-run cache of loaded tokenizers (`Tokenizers`). The
tokenizer is read from the run's `base_checkpoint`, a Hugging Face folder: `tokenizer.json`
(the `tokenizers` library) and the chat template from `chat_template.jinja`,
`tokenizer_config.json` or `chat_template.json`, rendered with Jinja2 in a sandbox the way
Hugging Face renders it (trimmed blocks, loop controls, `tojson`, `raise_exception`,
`strftime_now`, the special tokens as variables). No transformers and no torch: the
control plane stays light.

Must never re-tokenize text the engine produced or ids already recorded: the caller
concatenates recorded ids with what this module returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# A placeholder assistant reply: the template's text after it is the end-of-turn marker.
_MARK = "\u2063TETHER-REPLY\u2063"
# A neutral conversation to render new messages after, when the template renders the real
# history differently once more messages follow it (some templates drop old reasoning).
_PROBE = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerUnavailable(Exception):
    """The run names no tokenizer the control plane can load (see `base_checkpoint`)."""


class TemplateError(Exception):
    """The chat template refused the messages (its own error text says why)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    found = config.get("chat_template")
    side = folder / "chat_template.json"  # some checkpoints keep it beside the config
    if found is None and side.is_file():
        found = json.loads(side.read_text()).get("chat_template")
    if isinstance(found, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default") or next(iter(named.values()), None)
    return found if isinstance(found, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_template(source: str) -> Any:
    """A chat template compiled in Jinja2's sandbox, with Hugging Face's extras."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _renderable(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: content text ("" for none) and tool-call
    arguments as objects (Hugging Face templates serialise them themselves)."""
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        out["content"] = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                    function["arguments"] = json.loads(arguments)
            call["function"] = function
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


class ChatTokenizer:
    """One run's tokenizer with its chat template."""

    def __init__(
        self, tokenizer: Any, template: Any, special: Mapping[str, str | None], source: str
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.special = dict(special)
        self.source = source
        self._suffix: str | None = None

    @classmethod
    def load(cls, source: str) -> ChatTokenizer:
        """The tokenizer and chat template of the Hugging Face folder `source`."""
        from tokenizers import Tokenizer

        folder = Path(source)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerUnavailable(
                f"the run's base_checkpoint {source!r} is not a folder holding tokenizer.json "
                "on the control plane's machine: create the run with a local Hugging Face "
                "folder (the one the engines boot from)"
            )
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # a missing, unreadable or malformed file alike
            raise TokenizerUnavailable(
                f"could not read the tokenizer in {source!r} ({type(exc).__name__}: {exc})"
            ) from exc
        template = _template_source(folder, config)
        if not template:
            raise TokenizerUnavailable(
                f"the tokenizer in {source!r} has no chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template)"
            )
        try:
            compiled = compile_template(template)
        except Exception as exc:
            raise TokenizerUnavailable(
                f"the chat template in {source!r} does not compile: {exc}"
            ) from exc
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        return cls(tokenizer, compiled, special, source)

    # ------------------------------------------------------------------ text

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        generation_prompt: bool,
    ) -> str:
        try:
            text = self.template.render(
                messages=[_renderable(m) for m in messages],
                tools=tools or None,
                add_generation_prompt=generation_prompt,
                **self.special,
            )
        except TemplateError:
            raise
        except Exception as exc:
            raise TemplateError(f"{type(exc).__name__}: {exc}") from exc
        return str(text)

    def encode(self, text: str) -> list[int]:
        # The template writes any BOS itself; special tokens in it are matched as such.
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special=False)

    # ------------------------------------------------------------------ ids

    def first_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The ids of a conversation's first prompt (ending with the generation prompt)."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def end_of_turn(self) -> str:
        """What the template writes after an assistant reply's content ("<|im_end|>\\n")."""
        if self._suffix is None:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
            text = self.render(probe, None, generation_prompt=False)
            at = text.rfind(_MARK)
            self._suffix = text[at + len(_MARK) :] if at >= 0 else ""
        return self._suffix

    def bridge(self, last_completion: Sequence[int]) -> str:
        """The end-of-turn text the model did not sample itself: all of it after a reply
        cut by the token limit, the rest of it after a sampled end-of-turn token."""
        suffix = self.end_of_turn()
        if last_completion:
            tail = self.token_text(last_completion[-1])
            if tail and suffix.startswith(tail):
                return suffix[len(tail) :]
        return suffix

    def new_messages_text(
        self,
        history: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> str:
        """The template's text for `new` after `history` (which ends with a reply), up to
        and including the next generation prompt."""
        for before in (list(history), list(_PROBE)):
            base = self.render(before, tools, generation_prompt=False)
            full = self.render([*before, *new], tools, generation_prompt=True)
            if full.startswith(base):
                return full[len(base) :]
        raise TemplateError(
            "the chat template renders earlier messages differently once new ones follow, "
            "so new messages cannot be tokenized on their own"
        )

    def continuation(
        self,
        history: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        last_completion: Sequence[int],
    ) -> list[int]:
        """The ids a later turn adds after the recorded prompt and completion."""
        text = self.bridge(last_completion) + self.new_messages_text(history, new, tools)
        return self.encode(text)


class Tokenizers:
    """Loaded tokenizers by their source, shared by all runs naming the same folder."""

    def __init__(self) -> None:
        self._loaded: dict[str, ChatTokenizer] = {}
        self._lock = threading.Lock()

    def get(self, source: str | None, run_id: str) -> ChatTokenizer:
        """The tokenizer of `source` (blocking: call from a worker thread)."""
        if not source:
            raise TokenizerUnavailable(
                f"run {run_id!r} has no base_checkpoint, so the control plane has no "
                "tokenizer for its sessions: create the run with base_checkpoint = a Hugging "
                "Face folder holding the tokenizer and chat template"
            )
        if source.startswith("file://"):
            source = source[len("file://") :]
        with self._lock:
            found = self._loaded.get(source)
            if found is None:
                found = ChatTokenizer.load(source)
                self._loaded[source] = found
                log.info("run %s: loaded the tokenizer of %s", run_id, source)
            return found
