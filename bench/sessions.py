"""Sessions benchmark: prefix-cache hit rate and token-in/token-out integrity of multi-turn
sessions, sticky session placement against `X-Session-ID` affinity and random routing.

Starts a control plane (SQLite), publishes the tiny model as v0 of a folder store, and
serves it with `--engines` real vLLM engines (the CPU build from `.venv-vllm`, prefix
caching on, 32-token blocks so a turn's few new tokens do not hide inside one 128-token
block), an engine agent beside each. Then the same shape of workload runs once per policy:
`--sessions` conversations of `--turns` turns, `--concurrency` at a time. Every conversation
opens with one coding-agent system prompt that all share, then a task description of its
own; each later turn adds a tool result. Each turn repeats the whole history, so where it
lands decides how much of it the engine already holds.

- `sticky`: sessions (`POST /v1/sessions`, then OpenAI chat/completions at
  `<cp>/v1/sessions/{id}`): the control plane places the session on the least-loaded engine,
  keeps it there, applies the chat template and keeps the exact token ids itself;
- `affinity`: `POST /v1/generate` with an `X-Session-ID` header (rendezvous hashing), the
  client keeping the token ids (previous prompt + completion ids + the new message's);
- `random`: the same requests without a session id (the router's power-of-two choice).

Figures per policy: `prefix_cache_hit_rate` (vLLM's `vllm:prefix_cache_hits` over
`vllm:prefix_cache_queries`, both in tokens, summed over the engines between the first and
last turn of that policy; each engine's prefix cache is reset before a policy starts), turns
per second (wall) beside the client's CPU seconds per turn, and `tito_mismatches`: turns
whose recorded completion ids differ from the ids the engine returned, or whose prompt does
not start with the previous turn's exact prompt and completion ids (a re-tokenized
history). `retokenization_drift` counts the turns where tokenizing the conversation's text
again would NOT give the recorded ids, the error token-in/token-out avoids.

Run: `tether bench sessions` or `python -m bench.sessions`. The last line printed is one
JSON object: `sessions`, `prefix_cache_hit_rate` (sticky), `hit_rate_over_random`,
`tito_mismatches` (all policies), and the per-policy figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

RUN = "sessions-bench"
POLICIES = ("sticky", "affinity", "random")
START_DEADLINE_S = 900.0
# Small blocks: prefix hits are counted in whole blocks; the CPU build's default is 128.
VLLM_FLAGS = ("--enable-prefix-caching", "--block-size", "32")
MAX_MODEL_LEN = 2048
ROLES = ("trainer", "engine", "client")
_COUNTER = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))_total(?:\{[^}]*\})?\s+(\S+)$")
# The shared system prompt and the per-session texts are drawn from words the tiny model's
# tokenizer keeps whole, so their token counts are predictable (a word and a space each).
_WORDS = ("what", "is", "the", "sum", "of", "and", "plus", "minus", "answer", "question",
          "add", "two", "numbers", "digits", "yes", "no", "ok")  # fmt: skip


@dataclass
class Turn:
    """One turn as recorded by the policy's client (or the session's trajectory)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    # What the engine's answer said, to hold the record against: its completion ids (the
    # token route returns them), or its text (chat completions), and its token counts.
    returned_ids: list[int] | None = None
    returned_text: str | None = None
    returned_counts: tuple[int, int] | None = None  # (prompt tokens, completion tokens)


@dataclass
class PolicyFigures:
    policy: str
    sessions: int = 0
    turns: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    tito_mismatches: int = 0
    retokenization_drift: int = 0
    failures: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "prefix_cache_hit_rate": round(self.hits / self.queries, 4) if self.queries else None,
            "prefix_cache_hits": int(self.hits),
            "prefix_cache_queries": int(self.queries),
            "turns_per_s": round(self.turns / self.wall_s, 2) if self.wall_s else None,
            "client_cpu_ms_per_turn": round(1000 * self.cpu_s / self.turns, 3)
            if self.turns
            else None,
            "wall_s": round(self.wall_s, 2),
            "tito_mismatches": self.tito_mismatches,
            "retokenization_drift": self.retokenization_drift,
            "failures": len(self.failures),
        }


def _text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of the tiny tokenizer: words and two-digit numbers, spaced."""
    parts = [
        rng.choice(_WORDS) if rng.random() < 0.6 else str(rng.randrange(100))
        for _ in range(max(1, tokens // 2))
    ]
    return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """The conversations: one shared system prompt, then per session a task and tool turns."""

    sessions: int
    turns: int
    system_tokens: int
    task_tokens: int
    turn_tokens: int
    seed: int

    def system(self) -> str:
        return "You are a coding agent. " + _text(random.Random(self.seed), self.system_tokens)

    def user_messages(self, policy: str, index: int) -> list[str]:
        # Each policy gets conversations of its own: no policy finds another's in a cache.
        rng = random.Random(f"{self.seed}/{policy}/{index}")
        first = "Task: " + _text(rng, self.task_tokens)
        later = ["Tool result: " + _text(rng, self.turn_tokens) for _ in range(self.turns - 1)]
        return [first, *later]


def tito_mismatches(tokenizer: Any, turns: Sequence[Turn]) -> int:
    """Turns whose record differs from what the engine returned (ids, text or token counts),
    or whose prompt is not the previous turn's exact prompt + completion ids followed by new
    tokens (a re-tokenized history)."""
    bad = 0
    for i, turn in enumerate(turns):
        counts = (len(turn.prompt_ids), len(turn.completion_ids))
        wrong = (
            (turn.returned_ids is not None and turn.completion_ids != turn.returned_ids)
            or (turn.returned_counts is not None and counts != turn.returned_counts)
            or (
                turn.returned_text is not None
                and tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
                != turn.returned_text
            )
        )
        if i > 0:
            history = turns[i - 1].prompt_ids + turns[i - 1].completion_ids
            wrong = wrong or turn.prompt_ids[: len(history)] != history
        bad += wrong
    return bad


def retokenization_drift(tokenizer: Any, turns: Sequence[Turn]) -> int:
    """Turns whose ids (prompt + completion) differ from the ids of their decoded text."""
    drift = 0
    for turn in turns:
        ids = turn.prompt_ids + turn.completion_ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        drift += tokenizer.encode(text, add_special_tokens=False) != ids
    return drift


# --------------------------------------------------------------------------- the policies


async def _generate_session(
    client: Any,
    tokenizer: Any,
    workload: Workload,
    policy: str,
    index: int,
    max_tokens: int,
) -> list[Turn]:
    """One conversation through `/v1/generate`, the client keeping the token ids."""
    session_id = f"{policy}-{index}-{secrets.token_hex(4)}"
    headers = {"X-Session-ID": session_id} if policy == "affinity" else {}
    turns: list[Turn] = []
    for n, message in enumerate(workload.user_messages(policy, index)):
        if n == 0:
            chat = [
                {"role": "system", "content": workload.system()},
                {"role": "user", "content": message},
            ]
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            prompt = tokenizer.encode(text, add_special_tokens=False)
        else:
            last = turns[-1]
            # The history is the previous turn's exact ids; only the new message is tokenized.
            closing = "" if last.completion_ids[-1:] == [tokenizer.eos_token_id] else "<|im_end|>"
            suffix = f"{closing}\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
            new = tokenizer.encode(suffix, add_special_tokens=False)
            prompt = last.prompt_ids + last.completion_ids + new
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 1.0},
            "return_logprob": True,
            "run_id": RUN,
        }
        reply = await client.post("/v1/generate", json=body, headers=headers)
        reply.raise_for_status()
        answer = reply.json()
        meta = answer["meta_info"]
        returned = [int(entry[1]) for entry in meta["output_token_logprobs"]]
        counts = (int(meta["prompt_tokens"]), int(meta["completion_tokens"]))
        turns.append(Turn(prompt, list(answer["output_ids"]), returned, None, counts))
    return turns


async def _sticky_session(
    client: Any, workload: Workload, index: int, max_tokens: int
) -> list[Turn]:
    """One conversation through a session: OpenAI chat/completions, the server keeping ids."""
    created = await client.post(
        "/v1/sessions", json={"run_id": RUN, "version": {"min": 0}, "ttl_s": 600}
    )
    created.raise_for_status()
    session_id = created.json()["session_id"]
    base = f"/v1/sessions/{session_id}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": workload.system()}]
    answers: list[dict[str, Any]] = []
    try:
        for message in workload.user_messages("sticky", index):
            messages.append({"role": "user", "content": message})
            reply = await client.post(
                f"{base}/chat/completions",
                json={
                    "model": RUN,
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                },
            )
            reply.raise_for_status()
            answer = reply.json()
            # Sent back as answered: the session checks the history against its record.
            messages.append({"role": "assistant", "content": _content(answer)})
            answers.append(answer)
        record = await client.get(f"{base}/trajectory")
        record.raise_for_status()
    finally:
        await client.delete(base)
    turns = []
    for turn, answer in zip(record.json()["turns"], answers, strict=True):
        tether = answer["tether"]
        turns.append(
            Turn(
                [int(t) for t in turn["prompt_ids"]],
                [int(t) for t in turn["completion_ids"]],
                returned_text=_content(answer),
                returned_counts=(int(tether["prompt_tokens"]), int(tether["completion_tokens"])),
            )
        )
    return turns


def _content(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"].get("content") or "")


async def _run_policy(
    policy: str,
    cp_url: str,
    token: str,
    tokenizer: Any,
    workload: Workload,
    concurrency: int,
    max_tokens: int,
) -> tuple[list[list[Turn]], list[str]]:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    failures: list[str] = []

    async def one(client: httpx.AsyncClient, index: int) -> list[Turn]:
        async with limit:
            try:
                if policy == "sticky":
                    return await _sticky_session(client, workload, index, max_tokens)
                return await _generate_session(
                    client, tokenizer, workload, policy, index, max_tokens
                )
            except (httpx.HTTPError, KeyError, ValueError) as error:
                detail = (
                    error.response.text[:200] if isinstance(error, httpx.HTTPStatusError) else ""
                )
                failures.append(f"session {index}: {type(error).__name__}: {error} {detail}")
                return []

    transport = httpx.AsyncHTTPTransport(retries=0)
    async with httpx.AsyncClient(
        base_url=cp_url,
        headers={"Authorization": f"Bearer {token}"},
        timeout=300.0,
        transport=transport,
        limits=httpx.Limits(max_connections=concurrency + 4),
    ) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(workload.sessions)))
    return list(results), failures


# --------------------------------------------------------------------------- the fleet


def _engine_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens) from the engine's Prometheus page."""
    import httpx

    totals = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = _COUNTER.match(line)
        if match:
            totals[match.group(1)] += float(match.group(2))
    return totals


def _fleet_counters(urls: Sequence[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        counters = _engine_counters(url)
        hits += counters["vllm:prefix_cache_hits"]
        queries += counters["vllm:prefix_cache_queries"]
    return hits, queries


def _start_controlplane(processes: Any, root: Path) -> tuple[str, dict[str, str]]:
    """A control plane on SQLite and one token per role."""
    import httpx

    from launcher.processes import TETHER, ProcessFailed, free_port

    admin = "tth_bench-" + secrets.token_hex(16)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    processes.start(
        "controlplane",
        [TETHER, "controlplane", "serve", "--db", f"sqlite:///{root / 'cp.db'}",
         "--store", str(root / "store"), "--port", str(port), "--log-level", "warning"],
        env={"TETHER_ADMIN_TOKEN": admin, "TETHER_LEASE_SECONDS": "30",
             "TETHER_HEARTBEAT_INTERVAL_S": "1", "TETHER_SNAPSHOT_REFRESH_S": "0.1"},
        url=url,
    ).wait_http("/readyz", 120)  # fmt: skip
    tokens = {}
    for role in ROLES:
        reply = httpx.post(
            f"{url}/v1/tokens",
            json={"role": role, "name": f"bench-{role}"},
            headers={"Authorization": f"Bearer {admin}"},
            timeout=30,
        )
        if reply.status_code != 201:
            raise ProcessFailed(f"could not mint a {role} token: {reply.text}")
        tokens[role] = reply.json()["token"]
    return url, tokens


def _start_engines(
    processes: Any,
    root: Path,
    model: Path,
    cp_url: str,
    engine_token: str,
    count: int,
    capacity: int,
) -> list[tuple[str, str]]:
    """`count` vLLM engines (started together), then an agent beside each; the (engine,
    agent) URL pairs."""
    from launcher.processes import TETHER, free_port

    engines = []
    for index in range(count):
        port = free_port()
        engines.append(processes.start(
            f"vllm-{index}",
            [TETHER, "engine", "vllm", "--model", str(model), "--port", str(port),
             "--threads", "1", "--max-model-len", str(MAX_MODEL_LEN), "--", *VLLM_FLAGS],
            url=f"http://127.0.0.1:{port}",
        ))  # fmt: skip
    agents = []
    for index, engine in enumerate(engines):
        # vLLM starts in 20-50 s alone, minutes on a busy small machine.
        engine.wait_http("/health", START_DEADLINE_S, interval_s=0.2)
        port = free_port()
        agents.append(processes.start(
            f"agent-{index}",
            [TETHER, "agent", "run", "--engine-url", engine.url, "--engine-kind", "vllm",
             "--precision", "bf16", "--control-plane", cp_url, "--store", str(root / "store"),
             "--run", RUN, "--port", str(port), "--boot-model", str(model),
             "--boot-version", "0", "--work-dir", str(root / f"agent-{index}"),
             "--capacity", str(capacity), "--log-level", "warning"],
            env={"TETHER_TOKEN": engine_token, "TETHER_AGENT_POINTER_POLL_S": "0.5"},
            url=f"http://127.0.0.1:{port}",
        ))  # fmt: skip
    for agent in agents:
        agent.wait_http("/health", START_DEADLINE_S, interval_s=0.2)
    return [(engine.url, agent.url) for engine, agent in zip(engines, agents, strict=True)]


def _warm_up(agent_urls: Sequence[str]) -> None:
    """One request per engine, so no policy pays for a cold engine's first forward pass."""
    import httpx

    # 32 tokens, not 4: on an Intel VM with AVX-512/AMX flags vLLM 0.32's CPU worker died
    # with SIGILL prefilling a 4-token prompt (36 tokens were served).
    body = {"input_ids": [5, 17, 3, 42] * 8, "sampling_params": {"max_new_tokens": 2}}
    for url in agent_urls:
        httpx.post(f"{url}/generate", json=body, timeout=300).raise_for_status()


def _wait_routable(cp_url: str, token: str, count: int) -> None:
    """Until the control plane routes the run to all `count` engines."""
    import httpx

    from launcher.processes import wait_until

    def ready() -> bool:
        reply = httpx.get(
            f"{cp_url}/v1/engines",
            params={"run_id": RUN},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        engines = reply.json().get("engines", []) if reply.status_code == 200 else []
        serving = [e for e in engines if e.get("applied_version") == 0]
        return len(serving) >= count

    wait_until(ready, START_DEADLINE_S, "every engine routable for the run at v0")


def run(
    sessions: Annotated[int, typer.Option(help="Conversations per policy.")] = 100,
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = 8,
    engines: Annotated[int, typer.Option(help="vLLM engines (each with its agent).")] = 2,
    concurrency: Annotated[int, typer.Option(help="Conversations in flight at once.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Completion tokens per turn.")] = 8,
    system_tokens: Annotated[int, typer.Option(help="Shared system prompt (tokens).")] = 640,
    task_tokens: Annotated[int, typer.Option(help="Each conversation's task (tokens).")] = 128,
    turn_tokens: Annotated[int, typer.Option(help="Each later tool result (tokens).")] = 32,
    policies: Annotated[str, typer.Option(help="Comma-separated subset to run.")] = ",".join(
        POLICIES
    ),
    seed: Annotated[int, typer.Option(help="Seed of the conversations' text.")] = 0,
    work_dir: Annotated[Path | None, typer.Option(help="Keep logs and state here.")] = None,
) -> dict[str, Any]:
    """Sticky sessions vs X-Session-ID affinity vs random routing on real vLLM engines."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from launcher.processes import ProcessGroup
    from reference_engine.tiny_model import TinyModelSpec, init_tiny_model
    from trainer_client.publisher import Publisher

    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(POLICIES))
    if unknown or not chosen:
        raise SystemExit(f"--policies: expected some of {', '.join(POLICIES)}, got {policies!r}")
    if sessions < 1 or turns < 1 or engines < 1 or concurrency < 1:
        raise SystemExit("--sessions, --turns, --engines and --concurrency must be at least 1")
    workload = Workload(sessions, turns, system_tokens, task_tokens, turn_tokens, seed)
    console = Console()
    scratch = (
        tempfile.TemporaryDirectory(prefix="tether-bench-sessions-") if work_dir is None else None
    )
    root = Path(scratch.name) if scratch else Path(work_dir)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    figures: dict[str, PolicyFigures] = {}
    try:
        with ProcessGroup(root / "logs") as processes:
            with console.status("writing the tiny model, starting the control plane"):
                model = init_tiny_model(root / "model", TinyModelSpec())
                tokenizer = AutoTokenizer.from_pretrained(str(model))
                cp_url, tokens = _start_controlplane(processes, root)
                publisher = Publisher(
                    str(root / "store"), RUN, cp_url, tokens["trainer"], progress=False
                )
                publisher.claim(0, model)
                publisher.close()
            with console.status(f"starting {engines} vLLM engine(s) and their agents"):
                pairs = _start_engines(
                    processes, root, model, cp_url, tokens["engine"], engines, capacity=concurrency
                )
                _wait_routable(cp_url, tokens["client"], engines)
                _warm_up([agent for _, agent in pairs])
                urls = [engine for engine, _ in pairs]
            for policy in chosen:
                figures[policy] = _measure(
                    policy,
                    cp_url,
                    tokens["client"],
                    tokenizer,
                    workload,
                    urls,
                    concurrency,
                    max_tokens,
                    console,
                )
    finally:
        if scratch is not None:
            scratch.cleanup()
    return _report(console, figures, workload, engines)


def _measure(
    policy: str,
    cp_url: str,
    token: str,
    tokenizer: Any,
    workload: Workload,
    urls: Sequence[str],
    concurrency: int,
    max_tokens: int,
    console: Any,
) -> PolicyFigures:
    import httpx

    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    before = _fleet_counters(urls)
    wall, cpu = time.perf_counter(), time.process_time()
    with console.status(f"{policy}: {workload.sessions} sessions x {workload.turns} turns"):
        conversations, failures = asyncio.run(
            _run_policy(policy, cp_url, token, tokenizer, workload, concurrency, max_tokens)
        )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = _fleet_counters(urls)
    done = [c for c in conversations if c]
    result = PolicyFigures(
        policy,
        sessions=len(done),
        turns=sum(len(c) for c in done),
        wall_s=wall,
        cpu_s=cpu,
        hits=after[0] - before[0],
        queries=after[1] - before[1],
        tito_mismatches=sum(tito_mismatches(tokenizer, c) for c in done),
        retokenization_drift=sum(retokenization_drift(tokenizer, c) for c in done),
        failures=failures,
    )
    for failure in failures[:3]:
        console.print(f"[red]{policy}:[/] {failure}", markup=False)
    return result


def _report(
    console: Any, figures: dict[str, PolicyFigures], workload: Workload, engines: int
) -> dict[str, Any]:
    from rich.table import Table

    table = Table(
        "policy",
        "sessions",
        "turns",
        "cache hits",
        "turns/s",
        "CPU ms/turn",
        "TITO bad",
        "retok. drift",
    )
    per_policy = {name: f.as_json() for name, f in figures.items()}
    for name, row in per_policy.items():
        table.add_row(
            name,
            str(row["sessions"]),
            str(row["turns"]),
            f"{row['prefix_cache_hit_rate']}",
            f"{row['turns_per_s']}",
            f"{row['client_cpu_ms_per_turn']}",
            str(row["tito_mismatches"]),
            str(row["retokenization_drift"]),
        )
    console.print(table)
    sticky = per_policy.get("sticky", {}).get("prefix_cache_hit_rate")
    randomly = per_policy.get("random", {}).get("prefix_cache_hit_rate")
    summary = {
        "sessions": per_policy.get("sticky", next(iter(per_policy.values())))["sessions"],
        "turns_per_session": workload.turns,
        "engines": engines,
        "prefix_cache_hit_rate": sticky,
        "hit_rate_over_random": round(sticky / randomly, 3) if sticky and randomly else None,
        "tito_mismatches": sum(f.tito_mismatches for f in figures.values()),
        "failures": sum(len(f.failures) for f in figures.values()),
        "policies": per_policy,
    }
    if sticky and randomly:
        ratio = summary["hit_rate_over_random"]
        console.print(
            f"sticky placement: {sticky:.1%} of prompt tokens from the prefix cache, "
            f"{ratio}x random routing's {randomly:.1%}"
        )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    typer.run(run)
