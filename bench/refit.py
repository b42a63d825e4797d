"""Refit benchmark: how long a published delta pauses generation, staged vs naive reload.

Builds a ~200M-parameter Qwen3-shaped model (the tiny model's generator with bigger
dimensions), publishes it as v0 to a folder store, serves it with an engine (`--engine
reference`: the CPU reference engine; `--engine vllm`: vLLM's CPU build from `.venv-vllm`)
behind an engine agent (no control plane: the agent follows the store pointer), keeps a
client generating through the agent, publishes a delta v1 and measures:

- `staging_s`: the agent's fetch + fold/verify + convert + write, while the engine serves,
  and each of those stages as GB/s of BF16 checkpoint (`fetch_gb_s`, `fold_verify_gb_s`,
  `convert_gb_s` for `--precision`, `write_gb_s`) on the agent's wall clock;
- `stages_gb_s_per_core` / `stages_gb_s_wall`: the same catch-up of v1 run in this process
  (`bench.catchup`: fetch, fold + verify, convert to FP8, convert to NVFP4, write the staged
  folder), per core (thread CPU time, one codec and one torch thread) beside the wall clock,
  each stage the better of two runs (the first touches fresh memory, which on a VM whose
  host backs pages on first touch cost the fold 3-4x);
- `pause_s`: how long the engine was paused for the commit (pause → load → continue);
- `requests_during_staging`: client requests completed inside the staging window;
- `full_reload_pause_s`: the naive refit, where the engine stops serving until a fresh
  engine process has built the model from the new checkpoint folder (a restart);
- `unstaged_update_pause_s`: the other naive refit, pausing first and then fetching,
  folding, writing and loading (`update_weights_from_disk`; vLLM: `reload_weights`) with
  nothing prepared in advance;
- `agent_gc_pauses`, `agent_gc_s`, `agent_gc_pauses_over_20ms`: the agent's cycle
  collections from the moment it serves until its commit (`--no-agent-gc-settle`: with
  CPython's collector as it was, every full collection rescanning the agent's imports);
  `--no-agent-warm-codecs` leaves the codecs' and converters' imports and kernels to the
  agent's first catch-up (v1's), as before they were warmed at boot; `agent_codecs_warm_s`
  and `agent_conversion_warm_s`: what warming took at boot (0 when off; conversion: 0 for
  bf16);
- `agent_health_{p50,p99,max}_ms_staging`: a `GET /health` every 20 ms while the agent
  stages v1, answered on its event loop: how long staging (threads sharing the GIL) and
  collections keep that loop, and so its heartbeats and proxied requests, waiting;
- `logprobs_match_after_commit`: after the staged commit, the engine's prompt logprobs
  equal those transformers computes for v1 (bf16 tolerance) — the weights really changed.

Run: `tether bench refit` or `python -m bench.refit`. The last line printed is one JSON
object with the figures.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.catchup import STAGES, catchup_stages
from bench.figures import significant

RUN = "refit-bench"
ENGINES = ("reference", "vllm")
PROMPT = [5, 17, 3, 42, 9, 11, 60, 2]
BF16_ATOL = 0.05


def _engine_argv(engine: str, model: Path, port: int) -> tuple[list[str], str]:
    """The engine's command line and the path that answers once it serves."""
    from launcher.processes import TETHER

    if engine == "vllm":
        return [TETHER, "engine", "vllm", "--model", str(model), "--port", str(port)], "/health"
    return [TETHER, "engine", "reference", "--model", str(model), "--port", str(port)], "/ready"


def _unstaged_update(http: Any, engine: str, load: Any) -> tuple[float, Any]:
    """Pause, build the folder (`load()` returns it), load it, resume; the pause and reply."""
    started = time.perf_counter()
    if engine == "vllm":
        http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        folder = load()
        reply = http.post(
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
        )
        http.post("/update_weight_version", json={"new_version": "2"})
        http.post("/resume")
    else:
        http.post("/pause_generation", json={"mode": "abort"})
        folder = load()
        reply = http.post(
            "/update_weights_from_disk", json={"model_path": str(folder), "weight_version": "2"}
        )
        http.post("/continue_generation", json={})
    return time.perf_counter() - started, reply


def _logprobs_match(url: str, boot: Path, tensors: Any) -> tuple[bool, float]:
    """Whether the engine's prompt logprobs equal transformers' for `tensors` (and the gap)."""
    import httpx
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from store.torch_bridge import raw_to_state_dict

    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = httpx.post(f"{url}/generate", json=body, timeout=120)
    reply.raise_for_status()
    served = [t[0] for t in reply.json()["meta_info"]["input_token_logprobs"][1:]]
    config = json.loads((boot / "config.json").read_text())
    config.pop("architectures", None)
    model = Qwen3ForCausalLM(Qwen3Config(**config))
    model.load_state_dict(raw_to_state_dict(tensors), strict=False)
    # transformers wraps `to` in a decorator whose stub mypy misreads.
    model = model.to(torch.bfloat16).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    expected = [float(logprobs[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    gap = max(abs(a - b) for a, b in zip(served, expected, strict=True))
    return gap < BF16_ATOL, gap


def training_step(tensors: dict, seed: int, fraction: float = 0.05) -> dict:
    """A training-like update of canonical tensors (`RawTensor`s): about `fraction` of each
    tensor's values move a little; every value stays finite."""
    import torch

    from store.torch_bridge import raw_to_state_dict, to_raw

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in raw_to_state_dict(tensors).items():
        values = tensor.float()
        mask = torch.rand(values.shape, generator=generator) < fraction
        step = torch.randn(values.shape, generator=generator) * 1e-2
        out[name] = to_raw((values + mask * step).to(tensor.dtype))
    return out


def _stage_with_and_without_incremental(
    root: Path, precision: str, boot: Path, v0: dict, v1: dict
) -> dict[str, Any]:
    """The agent's stager on v1, converting incrementally from v0 and in full (in process).

    The running agent converts its first version after a start in full (it has converted
    nothing yet), so the incremental figures come from a stager that staged v0 first.
    """
    from engine_agent.staging import Stager
    from store.codecs import encode_version, fold

    # v1 as the agent holds it: folded from a sparse delta onto v0, so each patched tensor
    # carries the positions the fold changed and the stager does not diff the versions.
    delta = encode_version(v1, v0, version=1, base_version=0, codec="sparse")
    folded = fold(v0, [delta])
    following = Stager(root / "stage-incremental", precision, boot)
    following.stage(0, v0)
    incremental = following.stage(1, folded)
    full = Stager(root / "stage-full", precision, boot, incremental=False).stage(1, folded)
    return {
        "convert_incremental_s": significant(incremental.convert_s, 4),
        "convert_full_s": significant(full.convert_s, 4),
        "write_incremental_s": significant(incremental.write_s, 4),
        "write_full_s": significant(full.write_s, 4),
        "incremental_conversion": incremental.conversion,
        "convert_positions_from_fold": following.positions_from_fold,
        "staged_identical": incremental.checksums == full.checksums,
    }


def _agent_samples(agent_url: str) -> dict[tuple[str, str | None], float]:
    """The agent's `/metrics` samples now, keyed (sample name, its `le` label or None)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{agent_url}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels.get("le")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _gc_pauses(samples: dict[tuple[str, str | None], float]) -> tuple[float, float, float]:
    """The agent's cycle collections in `samples`: how many, their seconds, and how many
    held it 20 ms or less (from `tether_agent_gc_pause_seconds`)."""
    return (
        samples[("tether_agent_gc_pause_seconds_count", None)],
        samples[("tether_agent_gc_pause_seconds_sum", None)],
        samples[("tether_agent_gc_pause_seconds_bucket", "0.02")],
    )


def _client_loop(url: str, stop: threading.Event, done: list[float], tokens: int) -> None:
    import httpx

    body = {"text": "1 + 2 =", "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            try:
                if client.post(f"{url}/generate", json=body).status_code == 200:
                    done.append(time.time())
            except httpx.HTTPError:
                pass


def _probe_loop(url: str, stop: threading.Event, seen: list[tuple[float, float]]) -> None:
    """`GET /health` every 20 ms on a kept connection: (sent at, seconds to answer). The
    agent answers it on its event loop, so the time is how long that loop kept it waiting
    (its heartbeats and the requests it proxies wait the same)."""
    import httpx

    with httpx.Client(timeout=60) as client:
        while not stop.wait(0.02):
            sent, started = time.time(), time.perf_counter()
            try:
                client.get(f"{url}/health")
            except httpx.HTTPError:
                continue
            seen.append((sent, time.perf_counter() - started))


def _window_ms(seen: list[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    """p50, p99 and max (ms) of the probes sent in [start, end]."""
    import numpy as np

    times = np.array([s for at, s in seen if start <= at <= end]) * 1000
    if not times.size:
        return {"probes": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "probes": int(times.size),
        "p50_ms": significant(float(np.percentile(times, 50)), 3),
        "p99_ms": significant(float(np.percentile(times, 99)), 3),
        "max_ms": significant(float(times.max()), 3),
    }


def run(
    hidden: int = 1024,
    layers: int = 16,
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 64,
    intermediate: int = 3072,
    precision: str = "bf16",
    client_tokens: int = 4,
    engine: str = "reference",
    work_dir: Path | None = None,
    update_fraction: float = 0.05,
    agent_gc_settle: bool = True,
    agent_warm_codecs: bool = True,
) -> dict[str, Any]:
    """Measure one staged refit against naive reloads on a model of the given dimensions,
    served by ENGINE (reference | vllm)."""
    import httpx
    from rich.console import Console
    from rich.table import Table

    from engine_agent.precision.checkpoint import (
        copy_side_files,
        read_tensors,
        write_safetensors_folder,
    )
    from launcher.processes import TETHER, ProcessGroup, free_port
    from reference_engine.tiny_model import TinyModelSpec, init_tiny_model
    from store.codecs import encode_version
    from store.store import Store
    from store.torch_bridge import raw_to_state_dict, state_dict_to_raw
    from store.types import VersionRef

    if engine not in ENGINES:
        raise SystemExit(f"--engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "vllm" and precision != "bf16":
        raise SystemExit("--precision: the vLLM engine is measured in bf16 only (CPU build)")
    console = Console()
    scratch = (
        tempfile.TemporaryDirectory(prefix="tether-bench-refit-") if work_dir is None else None
    )
    root = Path(scratch.name) if scratch else Path(work_dir)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    processes = ProcessGroup(root)
    try:
        with console.status("building the model and publishing v0"):
            spec = TinyModelSpec(
                hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, intermediate=intermediate,
            )  # fmt: skip
            boot = init_tiny_model(root / "boot", spec)
            if precision != "bf16":
                from engine_agent.precision import convert_checkpoint

                convert_checkpoint(boot, precision, root / f"boot-{precision}")
            served_boot = boot if precision == "bf16" else root / f"boot-{precision}"
            v0 = state_dict_to_raw(read_tensors(boot))
            parameters = sum(t.numel for t in v0.values())
            store = Store(str(root / "store"))
            store.create_run(RUN)
            store.publish(
                VersionRef(RUN, 0),
                encode_version(v0, None, version=0, base_version=None, codec="full"),
            )
        engine_port, agent_port = free_port(), free_port()
        engine_url, agent_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{agent_port}"
        with console.status("starting the engine and its agent"):
            argv, ready_path = _engine_argv(engine, served_boot, engine_port)
            server = processes.start("engine", argv, url=engine_url)
            agent = processes.start(
                "agent",
                [TETHER, "agent", "run", "--engine-url", engine_url, "--precision", precision,
                 "--engine-kind", "vllm" if engine == "vllm" else "sglang",
                 "--store", str(root / "store"), "--run", RUN, "--port", str(agent_port),
                 "--boot-model", str(served_boot), "--boot-version", "0",
                 "--work-dir", str(root / "agent")],
                env={
                    "TETHER_AGENT_POINTER_POLL_S": "0.2",
                    "TETHER_AGENT_GC_SETTLE": "1" if agent_gc_settle else "0",
                    "TETHER_AGENT_WARM_CODECS": "1" if agent_warm_codecs else "0",
                },
                url=agent_url,
            )  # fmt: skip
            server.wait_http(ready_path, 900, interval_s=0.05)
            agent.wait_http("/health", 600, interval_s=0.05)
        booted = _agent_samples(agent_url)
        gc_before = _gc_pauses(booted)

        stop = threading.Event()
        done: list[float] = []
        client = threading.Thread(
            target=_client_loop, args=(agent_url, stop, done, client_tokens), daemon=True
        )
        client.start()
        probes: list[tuple[float, float]] = []
        probe = threading.Thread(target=_probe_loop, args=(agent_url, stop, probes), daemon=True)
        probe.start()
        with console.status("publishing v1 (delta) and waiting for the agent's commit"):
            v1 = training_step(v0, seed=1, fraction=update_fraction)
            files = encode_version(v1, v0, version=1, base_version=0, codec="sparse")
            published_at = time.time()
            store.publish(VersionRef(RUN, 1), files)
            agent.wait_http(
                "/server_info", 900, ready=lambda r: r.json()["applied_version"] == 1,
                interval_s=0.05,
            )  # fmt: skip
        stop.set()
        client.join(120)
        probe.join(120)
        gc_after = _gc_pauses(_agent_samples(agent_url))
        gc_pauses = [b - a for a, b in zip(gc_before, gc_after, strict=True)]
        last = httpx.get(f"{agent_url}/server_info", timeout=10).json()["last_pass"]
        commit_started = last["finished_at"] - last["commit_s"]
        staging_started = commit_started - last["stage_s"]
        during = sum(1 for t in done if staging_started <= t <= commit_started)
        health = _window_ms(probes, staging_started, commit_started)
        with console.status("comparing the engine's logprobs with transformers' for v1"):
            # Quantized engines differ from BF16 by design; the check is for BF16.
            matched, gap = (
                _logprobs_match(agent_url, boot, v1) if precision == "bf16" else (None, None)
            )
        agent.stop(15)

        # Naive 1: pause, then fetch + fold + write + load with nothing prepared in advance.
        with console.status("naive refit: an unstaged update"):
            v2 = training_step(v1, seed=2)
            store.publish(
                VersionRef(RUN, 2),
                encode_version(v2, None, version=2, base_version=None, codec="full"),
            )
            folder = root / "naive-v2"

            def load() -> Path:
                tensors = store.materialize(RUN, 2)
                if precision == "bf16":
                    write_safetensors_folder(folder, raw_to_state_dict(tensors))
                    copy_side_files(boot, folder)
                    (folder / "config.json").write_text((boot / "config.json").read_text())
                else:
                    from engine_agent.precision import convert_checkpoint

                    convert_checkpoint(
                        raw_to_state_dict(tensors),
                        precision,
                        folder,
                        config=json.loads((boot / "config.json").read_text()),
                        side_files_from=boot,
                    )
                return folder

            with httpx.Client(base_url=engine_url, timeout=900) as http:
                unstaged_pause, reply = _unstaged_update(http, engine, load)
                assert reply.status_code == 200, reply.text
        server.stop(15)

        # Naive 2: the engine restarts from the new folder (constructs the model again).
        with console.status("naive refit: restart the engine on the new checkpoint"):
            port = free_port()
            started = time.perf_counter()
            argv, ready_path = _engine_argv(engine, folder, port)
            fresh = processes.start("restart", argv, url=f"http://127.0.0.1:{port}")
            fresh.wait_http(ready_path, 900, interval_s=0.05)
            restart_pause = time.perf_counter() - started
            fresh.stop(15)

        stages = (
            _stage_with_and_without_incremental(root, precision, served_boot, v0, v1)
            if precision != "bf16"
            else {}
        )
        with console.status("each catch-up stage of v1 in process, per core and on the wall"):
            per_core, wall = catchup_stages(v1, v0, root / "stages", repeats=2)
    finally:
        processes.stop_all(15)
        if scratch is not None:
            scratch.cleanup()

    figures = {
        "engine": engine,
        "parameters": parameters,
        "precision": precision,
        "staging_s": significant(last["stage_s"], 4),
        "fetch_s": significant(last["fetch_s"], 4),
        "fold_verify_s": significant(last["fold_verify_s"], 4),
        "convert_s": significant(last["convert_s"], 4),
        "write_s": significant(last["write_s"], 4),
        "pause_s": significant(last["pause_s"], 4),
        "commit_s": significant(last["commit_s"], 4),
        "publish_to_commit_s": significant(last["finished_at"] - published_at, 4),
        "requests_during_staging": during,
        "full_reload_pause_s": significant(restart_pause, 4),
        "unstaged_update_pause_s": significant(unstaged_pause, 4),
        "pause_over_full_reload": significant(last["pause_s"] / restart_pause, 4),
        "pause_over_unstaged_update": significant(last["pause_s"] / unstaged_pause, 4),
        "update_fraction": update_fraction,
        **stages,
        "stages_gb_s_per_core": per_core,
        "stages_gb_s_wall": wall,
        "logprobs_match_after_commit": matched,
        "logprobs_max_gap": None if gap is None else round(gap, 5),
        # The agent's cycle collections from serving until the commit (`gc_settle`).
        "agent_gc_settle": agent_gc_settle,
        # Codecs warmed at boot (`store/codecs/warm.py`), or loaded by the first fold.
        "agent_warm_codecs": agent_warm_codecs,
        "agent_codecs_warm_s": significant(booted[("tether_agent_codecs_warm_seconds", None)], 3),
        "agent_conversion_warm_s": significant(
            booted[("tether_agent_conversion_warm_seconds", None)], 3
        ),
        "agent_gc_pauses": int(gc_pauses[0]),
        "agent_gc_s": significant(gc_pauses[1], 3),
        "agent_gc_pauses_over_20ms": int(gc_pauses[0] - gc_pauses[2]),
        # `GET /health` every 20 ms while the agent staged v1: how long its loop kept it.
        "agent_health_probes_staging": health["probes"],
        "agent_health_p50_ms_staging": health["p50_ms"],
        "agent_health_p99_ms_staging": health["p99_ms"],
        "agent_health_max_ms_staging": health["max_ms"],
    }
    # Each catch-up stage as GB of BF16 checkpoint per second of the agent's wall clock (the
    # agent is another process, so its thread CPU time is not visible from here).
    checkpoint_bytes = 2 * parameters
    for stage in ("fetch", "fold_verify", "convert", "write"):
        seconds = figures[f"{stage}_s"]
        figures[f"{stage}_gb_s"] = (
            significant(checkpoint_bytes / seconds / 1e9) if seconds else None
        )
    table = Table("refit", "engine paused (s)", "vs staged")
    table.add_row("staged by the agent (commit only)", f"{figures['pause_s']:.3f}", "1.00x")
    for label, key in (
        ("naive: restart the engine on the folder", "full_reload_pause_s"),
        ("naive: pause, fetch, fold, write, load", "unstaged_update_pause_s"),
    ):
        ratio = figures[key] / max(figures["pause_s"], 1e-9)
        table.add_row(label, f"{figures[key]:.3f}", f"{ratio:.1f}x")
    console.print(table)
    if stages:
        console.print(
            f"stager, v1 after v0: convert {stages['convert_incremental_s']:.3f}s incremental "
            f"vs {stages['convert_full_s']:.3f}s full; write {stages['write_incremental_s']:.3f}s "
            f"vs {stages['write_full_s']:.3f}s; same staged bytes: {stages['staged_identical']}"
        )
    stage_table = Table("catch-up stage (in process)", "GB/s per core", "GB/s wall")
    for stage in STAGES:
        key = f"{stage}_gb_s"
        stage_table.add_row(stage.replace("_", " "), f"{per_core[key]:g}", f"{wall[key]:g}")
    console.print(stage_table)
    console.print(
        f"{engine} engine, {parameters / 1e6:.0f}M parameters ({precision}); staging "
        f"{figures['staging_s']:.2f}s outside the pause, {during} requests completed meanwhile"
    )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    import typer

    typer.run(run)
