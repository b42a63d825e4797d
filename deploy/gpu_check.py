"""The GPU check: Tether's weight sync against real SGLang on one NVIDIA GPU, end to end.

`python -m deploy.gpu_check` writes a small Qwen3-architecture model (BF16, and FP8 with
Tether's converter), starts one SGLang server per precision on loopback with a Tether agent
beside each, publishes two delta versions with the Publisher while clients keep generating,
then verifies, per precision and version:

- the publish is a delta; the agent catches up; SGLang's served version advances;
- generation succeeds before, during (requests in flight across the commit) and after it;
- the engine pause (the agent's measured pause, and the longest one-token probe);
- greedy (temperature 0) outputs equal those of a fresh SGLang loaded directly from the
  same version's weights (converted again for FP8).

One summary line per check, then a JSON line of the totals; exit code 1 if any failed.
Runs in a few minutes on one H100/H200 (not part of CI: it needs a GPU and SGLang).
`--plan` prints the steps and command lines without a GPU.

Must never be imported by library code; it owns nothing but this procedure.

Why over 500 lines: it is one procedure run by hand on a GPU node, read top to bottom as the
checklist it prints.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from deploy.fleet_config import DEFAULT_SGLANG_FLAGS
from deploy.replica import SGLANG_ENV, ReplicaSpec, agent_argv, sglang_argv

PRECISIONS = ("bf16", "fp8")
# NVFP4 runs natively on Blackwell (compute capability 10.0+); SGLang's ModelOpt NVFP4 dense
# path refuses older GPUs unless told to use Marlin, so the check adds it where it is native.
NVFP4 = "nvfp4"
NVFP4_MIN_CAPABILITY = (10, 0)
RUN_ID = "gpu-check"
DEFAULT_SGLANG = "sglang>=0.5.17"
# head_dim 128 keeps every SGLang attention backend available; 1024/3072 tile FP8 blocks.
MODEL_SHAPE = {"hidden": 1024, "layers": 4, "heads": 8, "kv_heads": 4, "head_dim": 128}
INTERMEDIATE = 3072
ENGINE_START_S = 600.0
CATCH_UP_S = 180.0
MAX_PAUSE_S = 30.0
PROMPTS = [[11, 12, 13, 14, 15], [21, 3, 7, 9], [5, 5, 5, 5, 5, 5, 5], [40, 41, 42], [8, 1]]

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


class Report:
    """The checks so far; each line is printed as soon as its check is decided."""

    def __init__(self) -> None:
        self.items: list[Check] = []

    def add(self, *checks: Check) -> bool:
        for check in checks:
            self.items.append(check)
            print(check.line(), flush=True)
        return all(c.ok for c in checks)


@dataclass
class Outcome:
    """One generate call made through an agent by the background clients (wall-clock
    times, comparable with the agent's pass timings)."""

    started: float
    ended: float
    ok: bool
    start_version: int | None = None
    end_version: int | None = None
    error: str = ""


@dataclass
class ReplicaUnderCheck:
    """One precision's SGLang + agent pair and what its clients saw."""

    precision: str
    spec: ReplicaSpec
    sglang: Any = None
    agent: Any = None
    outcomes: list[Outcome] = field(default_factory=list)
    probes: list[tuple[float, float]] = field(default_factory=list)

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.agent_port}"


def engine_flags(precision: str, cuda_graph: bool) -> tuple[str, ...]:
    """The fleet's precision flags plus what lets two engines share one GPU, reproducibly."""
    flags = [*DEFAULT_SGLANG_FLAGS[precision], "--mem-fraction-static", "0.2"]
    flags += ["--random-seed", "0", "--context-length", "2048", "--log-level", "warning"]
    # Served and directly loaded engines must compute each greedy answer the same way: no
    # prefix reuse from earlier batched requests.
    flags.append("--disable-radix-cache")
    if not cuda_graph:
        flags.append("--disable-cuda-graph")
    return tuple(flags)


def replica_spec(work: Path, precision: str, cuda_graph: bool, store_url: str) -> ReplicaSpec:
    from launcher.processes import free_port

    return ReplicaSpec(
        precision=precision,
        accelerator="gpu-check",
        run=RUN_ID,
        store_url=store_url,
        base_model=str(work / "base"),
        boot_version=0,
        sglang_flags=engine_flags(precision, cuda_graph),
        sglang_port=free_port(),
        agent_port=free_port(),
        agent_host="127.0.0.1",
        work_dir=str(work / precision),
        capacity=16,
        labels={"check": "gpu"},
    )


def gpu_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability from nvidia-smi, None without one."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        major, minor = listing.stdout.splitlines()[0].strip().split(".")
        return int(major), int(minor)
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        return None


def checked_precisions(kind: str, capability: tuple[int, int] | None) -> tuple[str, ...]:
    """BF16 and FP8 always; NVFP4 where the GPU runs it natively (and in the CPU rehearsal,
    whose reference engine dequantizes it)."""
    if kind == "reference" or (capability is not None and capability >= NVFP4_MIN_CAPABILITY):
        return (*PRECISIONS, NVFP4)
    return PRECISIONS


def print_plan(work: Path, cuda_graph: bool) -> None:
    store_url = f"file://{work}/store"
    print(f"work dir: {work}; store: {store_url}; run: {RUN_ID}")
    print("1. pip install sglang if it is missing; nvidia-smi must list a GPU")
    print(f"2. write a tiny Qwen3 {MODEL_SHAPE} intermediate {INTERMEDIATE} (BF16) and its FP8")
    print(f"   (and NVFP4 on a GPU of compute capability {NVFP4_MIN_CAPABILITY[0]}.0+)")
    print("3. Publisher.claim(0, base) → FULL v0 in the store")
    for precision in PRECISIONS:
        spec = replica_spec(work, precision, cuda_graph, store_url)
        print(f"4. [{precision}] {' '.join(sglang_argv(spec, python=sys.executable))}")
        print(f"5. [{precision}] {' '.join(agent_argv(spec))}")
    print("6. clients generate through both agents while v1 and v2 are published as deltas")
    print("7. per version: delta, catch-up, served version, generation across commit, pause")
    print("8. fresh SGLang on v2 loaded directly; greedy outputs must match the served ones")


# ---------------------------------------------------------------------- steps


def ensure_sglang(spec: str) -> Check:
    if importlib.util.find_spec("sglang") is not None:
        return Check("sglang", True, "already installed")
    started = time.monotonic()
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    done = subprocess.run([*pip, spec], capture_output=True, text=True)
    if done.returncode != 0:
        # Some of SGLang's dependencies publish only pre-releases (its install guide tells
        # uv users to pass --prerelease=allow); retry once allowing them.
        done = subprocess.run([*pip, "--pre", spec], capture_output=True, text=True)
    if done.returncode != 0:
        return Check("sglang", False, f"pip install {spec} failed: {done.stderr[-500:]}")
    return Check("sglang", True, f"installed {spec} in {time.monotonic() - started:.0f}s")


def gpu_present() -> Check:
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("gpu", False, f"nvidia-smi failed ({exc}); this check needs an NVIDIA GPU")
    gpus = [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]
    if listing.returncode != 0 or not gpus:
        return Check("gpu", False, f"nvidia-smi lists no GPU: {listing.stderr.strip()[:200]}")
    return Check("gpu", True, gpus[0])


def write_models(work: Path, kind: str, precisions: tuple[str, ...] = PRECISIONS) -> Check:
    from engine_agent.precision import convert_checkpoint
    from reference_engine.tiny_model import TinyModelSpec, init_tiny_model

    # A CPU rehearsal keeps init-tiny's default shape (still FP8-block aligned).
    shape = {**MODEL_SHAPE, "intermediate": INTERMEDIATE} if kind == "sglang" else {}
    base = init_tiny_model(work / "base", TinyModelSpec(**shape))
    # Each quantized engine boots from the folder its ReplicaSpec names (work/p/boot-p).
    fp8 = convert_checkpoint(base, "fp8", work / "fp8" / "boot-fp8")
    ok = fp8.quantized_modules > 0
    detail = f"BF16 at {base}; FP8 with {fp8.quantized_modules} block scales"
    if NVFP4 in precisions:
        nvfp4 = convert_checkpoint(base, NVFP4, work / NVFP4 / f"boot-{NVFP4}")
        ok = ok and nvfp4.quantized_modules > 0
        detail += f"; NVFP4 with {nvfp4.quantized_modules} quantized modules"
    return Check("models", ok, detail)


def perturbed(tensors: dict[str, Any], version: int) -> dict[str, Any]:
    """A training step's worth of change: a few rows of each MLP weight move (sparse delta)."""
    import torch

    generator = torch.Generator().manual_seed(version)
    out = {}
    for name, tensor in tensors.items():
        if ".mlp." in name and tensor.dim() == 2:
            changed = tensor.clone()
            rows = torch.randperm(tensor.shape[0], generator=generator)[: tensor.shape[0] // 16]
            noise = torch.randn(len(rows), tensor.shape[1], generator=generator) * 0.02
            changed[rows] = (changed[rows].float() + noise).to(tensor.dtype)
            out[name] = changed
        else:
            out[name] = tensor
    return out


def engine_argv(
    spec: ReplicaSpec, kind: str, model: str | None = None, version: int = 0
) -> list[str]:
    """SGLang (the check), or the CPU reference engine (a rehearsal of the script itself)."""
    model = model or spec.boot_dir
    if kind == "reference":
        return [
            sys.executable, "-m", "cli", "engine", "reference", "--model", model,
            "--host", "127.0.0.1", "--port", str(spec.sglang_port),
            "--precision", spec.precision, "--weight-version", str(version),
        ]  # fmt: skip
    argv = sglang_argv(spec, python=sys.executable)
    argv[argv.index("--model-path") + 1] = model
    argv[argv.index("--weight-version") + 1] = str(version)
    return argv


def start_engine(group: Any, engine: ReplicaUnderCheck, kind: str) -> None:
    engine.sglang = group.start(
        f"{kind}-{engine.precision}",
        engine_argv(engine.spec, kind),
        env=SGLANG_ENV,
        url=f"http://127.0.0.1:{engine.spec.sglang_port}",
    )


def start_agent(group: Any, engine: ReplicaUnderCheck) -> None:
    argv = [sys.executable, "-m", "cli", *agent_argv(engine.spec)[1:]]
    engine.agent = group.start(f"agent-{engine.precision}", argv, url=engine.agent_url)
    engine.agent.wait_http("/health", ENGINE_START_S)


def server_info(engine: ReplicaUnderCheck) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{engine.agent_url}/server_info", timeout=10).json()


def generate(url: str, input_ids: list[int], max_new_tokens: int, greedy: bool) -> dict:
    import httpx

    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    sampling |= (
        {"temperature": 0.0, "top_p": 1.0, "top_k": 1}
        if greedy
        else {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
        }
    )
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": greedy}
    reply = httpx.post(f"{url}/generate", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()


def client_loop(engine: ReplicaUnderCheck, stop: threading.Event, tokens: int, seed: int) -> None:
    """Generate continuously through the agent, recording every outcome."""
    prompt = PROMPTS[seed % len(PROMPTS)]
    while not stop.is_set():
        started = time.time()
        try:
            reply = generate(engine.agent_url, prompt, tokens, greedy=False)
        except Exception as exc:  # a failed request is a finding, never a crash
            engine.outcomes.append(Outcome(started, time.time(), False, error=repr(exc)))
            continue
        engine.outcomes.append(
            Outcome(
                started,
                time.time(),
                True,
                _as_int(reply.get("weight_version_start")),
                _as_int(reply.get("weight_version_end")),
            )
        )


def probe_loop(engine: ReplicaUnderCheck, stop: threading.Event) -> None:
    """One-token requests back to back: their longest latency bounds the pause from outside."""
    while not stop.is_set():
        started = time.time()
        with contextlib.suppress(Exception):
            generate(engine.agent_url, PROMPTS[0], 1, greedy=True)
        engine.probes.append((started, time.time() - started))


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def wait_for(predicate: Any, timeout_s: float) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; the checks that follow judge
    what happened, so running out of time is not an error here."""
    from launcher.processes import DeadlineExceeded, wait_until

    try:
        return bool(wait_until(predicate, timeout_s, "a condition of the check", 0.1))
    except DeadlineExceeded:
        return False


def finished_on(engine: ReplicaUnderCheck, version: int, since: float) -> bool:
    return any(o.ok and o.start_version == version and o.ended >= since for o in engine.outcomes)


def wait_applied(engine: ReplicaUnderCheck, version: int) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < CATCH_UP_S:
        info = server_info(engine)
        if info.get("applied_version") == version:
            return time.monotonic() - started
        if not engine.agent.alive():
            return None
        time.sleep(0.2)
    return None


def version_checks(engine: ReplicaUnderCheck, version: int, published_at: float) -> list[Check]:
    import httpx

    tag = f"[{engine.precision}] v{version}"
    checks = []
    took = wait_applied(engine, version)
    if took is None:
        info = server_info(engine) if engine.agent.alive() else {}
        return [Check(f"catch-up {tag}", False, f"not applied in {CATCH_UP_S:.0f}s: {info}")]
    checks.append(Check(f"catch-up {tag}", True, f"applied {took:.1f}s after publish"))
    sglang_url = f"http://127.0.0.1:{engine.spec.sglang_port}"
    label = httpx.get(f"{sglang_url}/model_info", timeout=10).json().get("weight_version")
    # A finished request's meta_info carries the version it ended on (SGLang sets it from
    # the tokenizer label, and from the last weight_versions span where spans exist).
    meta = generate(sglang_url, PROMPTS[1], 4, greedy=True).get("meta_info") or {}
    stamped = generate(engine.agent_url, PROMPTS[1], 4, greedy=True).get("weight_version_end")
    checks.append(
        Check(
            f"served version {tag}",
            label == str(version)
            and str(meta.get("weight_version")) == str(version)
            and _as_int(stamped) == version,
            f"SGLang /model_info says {label!r}, its meta_info.weight_version "
            f"{meta.get('weight_version')!r}, agent stamps {stamped!r}",
        )
    )
    # Requests admitted after the commit need a moment to finish.
    wait_for(lambda: finished_on(engine, version, published_at), 60.0)
    window = [o for o in engine.outcomes if o.ended >= published_at]
    failed = [o for o in window if not o.ok]
    passes = [p for p in server_info(engine).get("passes", []) if p.get("target") == version]
    last = passes[-1] if passes else {}
    # The commit window ends when the pass finished; requests overlapping it were in flight
    # or waiting at the closed gate while the engine was paused and reloaded.
    commit_end = last.get("finished_at") or time.time()
    commit_start = commit_end - max(last.get("commit_s", 0.0), last.get("pause_s", 0.0))
    before = sum(1 for o in window if o.ok and o.end_version == version - 1)
    during = sum(1 for o in window if o.ok and o.started <= commit_end and o.ended >= commit_start)
    across = sum(1 for o in window if o.start_version == version - 1 and o.end_version == version)
    after = sum(1 for o in window if o.ok and o.start_version == version)
    checks.append(
        Check(
            f"generation across commit {tag}",
            not failed and before > 0 and during > 0 and after > 0,
            f"{before} finished on v{version - 1} while staging, {during} overlapped the commit "
            f"({across} began on v{version - 1} and ended on v{version}), {after} on "
            f"v{version}, {len(failed)} failed"
            + (f" (first: {failed[0].error})" if failed else ""),
        )
    )
    pause = last.get("pause_s")
    probes = [latency for at, latency in engine.probes if at >= published_at]
    longest = max(probes) if probes else float("nan")
    checks.append(
        Check(
            f"engine pause {tag}",
            pause is not None and 0 < pause < MAX_PAUSE_S,
            f"agent pause {pause if pause is None else f'{pause * 1000:.0f} ms'}, "
            f"stage {last.get('stage_s', 0.0):.2f}s, "
            f"longest one-token probe {longest * 1000:.0f} ms",
        )
    )
    return checks


def direct_outputs(url: str) -> list[list[int]]:
    return [generate(url, prompt, 24, greedy=True)["output_ids"] for prompt in PROMPTS]


def write_direct_version(work: Path, tensors: dict[str, Any], version: int) -> dict[str, Path]:
    """The version's weights written straight from the trainer's tensors, per precision."""
    from engine_agent.precision import convert_checkpoint
    from engine_agent.precision.checkpoint import copy_side_files, write_safetensors_folder

    bf16 = work / "direct" / f"v{version}-bf16"
    bf16.mkdir(parents=True, exist_ok=True)
    write_safetensors_folder(bf16, dict(tensors))
    shutil.copyfile(work / "base" / "config.json", bf16 / "config.json")
    copy_side_files(work / "base", bf16)
    fp8 = work / "direct" / f"v{version}-fp8"
    convert_checkpoint(bf16, "fp8", fp8)
    folders = {"bf16": bf16, "fp8": fp8}
    boot_nvfp4 = work / NVFP4 / f"boot-{NVFP4}"
    if boot_nvfp4.is_dir():
        from engine_agent.precision import read_input_scales

        # The agent stages NVFP4 with the boot checkpoint's input scales; so does this.
        folders[NVFP4] = work / "direct" / f"v{version}-{NVFP4}"
        convert_checkpoint(bf16, NVFP4, folders[NVFP4], read_input_scales(boot_nvfp4))
    return folders


def compare_outputs(precision: str, served: list[list[int]], direct: list[list[int]]) -> Check:
    same = sum(1 for a, b in zip(served, direct, strict=True) if a == b)
    detail = f"{same}/{len(served)} prompts identical over 24 greedy tokens"
    if same != len(served):
        first = next(i for i, (a, b) in enumerate(zip(served, direct, strict=True)) if a != b)
        detail += f"; prompt {first}: served {served[first][:8]}… direct {direct[first][:8]}…"
    return Check(
        f"temperature-0 match [{precision}] v2 vs direct load", same == len(served), detail
    )


def run_check(work: Path, sglang_spec: str, cuda_graph: bool, kind: str = "sglang") -> Report:
    from launcher.processes import ProcessFailed, ProcessGroup
    from trainer_client.publisher import Publisher, load_hf_folder

    report = Report()
    if kind == "sglang":
        for preflight in (gpu_present, lambda: ensure_sglang(sglang_spec)):
            if not report.add(preflight()):
                return report
    precisions = checked_precisions(kind, gpu_capability() if kind == "sglang" else None)
    report.add(Check("precisions", True, ", ".join(precisions)))
    report.add(write_models(work, kind, precisions))
    tokens = 96 if kind == "sglang" else 12
    store_url = f"file://{work}/store"
    publisher = Publisher(store_url, RUN_ID, progress=False)
    publisher.claim(0, work / "base")
    engines = [
        ReplicaUnderCheck(p, replica_spec(work, p, cuda_graph, store_url)) for p in precisions
    ]
    stop = threading.Event()
    threads: list[threading.Thread] = []
    # The group stops every child on the way out, on success, error or Ctrl-C.
    with ProcessGroup(work / "logs") as group:
        try:
            started = time.monotonic()
            for engine in engines:
                start_engine(group, engine, kind)
            for engine in engines:
                engine.sglang.wait_http("/model_info", ENGINE_START_S)
                start_agent(group, engine)
            took = time.monotonic() - started
            count = len(engines)
            detail = f"{count} engines + {count} agents up in {took:.0f}s"
            report.add(Check("startup", True, detail))
            for engine in engines:
                for seed in range(3):
                    threads.append(
                        threading.Thread(target=client_loop, args=(engine, stop, tokens, seed))
                    )
                threads.append(threading.Thread(target=probe_loop, args=(engine, stop)))
            for thread in threads:
                thread.start()
            weights = load_hf_folder(work / "base")
            since = time.time()
            for version in (1, 2):
                # Every engine must be serving the old version when the new one lands.
                wait_for(
                    lambda v=version, t=since: all(finished_on(e, v - 1, t) for e in engines),
                    60.0,
                )
                weights = perturbed(weights, version)
                published_at = since = time.time()
                published = publisher.publish(weights, version)
                report.add(
                    Check(
                        f"publish v{version}",
                        published.kind.value.lower() == "delta",
                        f"{published.kind.value} {published.bytes / 1024:.0f} KiB "
                        f"({published.ratio_to_full:.1%} of full) in {published.total_s:.2f}s",
                    )
                )
                for engine in engines:
                    report.add(*version_checks(engine, version, published_at))
            stop.set()
            for thread in threads:
                thread.join(timeout=150)
            served = {e.precision: direct_outputs(e.agent_url) for e in engines}
            for engine in engines:
                engine.agent.stop(grace_s=20)
                engine.sglang.stop(grace_s=20)
            folders = write_direct_version(work, weights, 2)
            direct = []
            for precision in precisions:
                spec = replica_spec(work, precision, cuda_graph, store_url)
                argv = engine_argv(spec, kind, str(folders[precision]), version=2)
                url = f"http://127.0.0.1:{spec.sglang_port}"
                direct.append(group.start(f"direct-{precision}", argv, env=SGLANG_ENV, url=url))
            for precision, process in zip(precisions, direct, strict=True):
                process.wait_http("/model_info", ENGINE_START_S)
                assert process.url is not None  # started with url= above
                answers = direct_outputs(process.url)
                report.add(compare_outputs(precision, served[precision], answers))
        except ProcessFailed as exc:
            report.add(Check("processes", False, str(exc)))
        except Exception as exc:  # any other crash is a failed check, reported, never hidden
            report.add(Check("unexpected error", False, f"{exc.__class__.__name__}: {exc}"))
        finally:
            stop.set()
            publisher.close()
    failed = [o for e in engines for o in e.outcomes if not o.ok]
    total = sum(len(e.outcomes) for e in engines)
    report.add(Check("no failed requests", not failed, f"{total - len(failed)}/{total} ok"))
    return report


@app.command()
def main(
    work_dir: Path = typer.Option(None, "--work-dir", help="Folder for models, store, logs."),
    sglang: str = typer.Option(DEFAULT_SGLANG, "--sglang", help="pip spec if SGLang is missing."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="Keep SGLang's CUDA graphs."),
    plan: bool = typer.Option(False, "--plan", help="Print the steps and commands; run nothing."),
    keep: bool = typer.Option(False, "--keep", help="Keep the work folder afterwards."),
    engine: str = typer.Option(
        "sglang", "--engine", help="sglang, or reference: rehearse on CPU with Tether's engine."
    ),
) -> None:
    """Check Tether's weight sync against real SGLang on this machine's GPU."""
    work = work_dir or Path(tempfile.mkdtemp(prefix="tether-gpu-check-"))
    if plan:
        print_plan(work, cuda_graph)
        return
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if engine not in ("sglang", "reference"):
        print(f"error: --engine must be sglang or reference, found {engine!r}", file=sys.stderr)
        raise typer.Exit(2)
    checks = run_check(work, sglang, cuda_graph, engine).items
    failed = [c for c in checks if not c.ok]
    summary: dict[str, float] = {"passed": len(checks) - len(failed), "failed": len(failed)}
    summary["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary))
    if failed or keep:
        print(f"logs and models kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    raise typer.Exit(1 if failed else 0)


if __name__ == "__main__":
    app()
