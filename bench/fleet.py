"""`tether bench fleet`: a swarm of real engine agents catching up on a chain of versions.

Starts its own PostgreSQL (`launcher.postgres`), SeaweedFS S3 (`launcher.seaweed`) and a
control plane on them, then runs N real `engine_agent.agent.Agent`s in this one process
(asyncio): each its reconciler (fetch, fold, verify, staging, commit), heartbeats and target
long-polls over real HTTP, its own proxy port, and a `NullEngine` that only records commits.
Every agent reads the store through a `CappedObjects` (bench/capped_link.py): its own link
capped at `--agent-link-mbps` and the store's egress capped at `--store-egress-mbps`, so
the figures model a cloud rather than loopback.

The run: one agent alone catches up on v1 (the single-engine catch-up time under the same
caps), then the other agents start (booted on v0, they catch up on v1), then `--versions`
versions are published one at a time, each once the fleet serves the previous one. Per
version: seconds from publication until 50/90/99/100 % of the engines serve it, store bytes
read while it spread over its size, and every long-poll that woke an agent for it. Over the
whole chain: heartbeat round trips as the agents see them, control-plane CPU.

With several `--engines`, each scale runs on a fresh stack and two models of the time to 99 %
are fitted to the points (linear in N: the store's egress is the bottleneck; logarithmic in
N: a fan-out tree is), with their error on the measured points and their prediction for
10,000 engines. Ends with ONE JSON line (the largest scale's figures and the models).
It measures; it never asserts. Heavy scales are a benchmark, never a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections import Counter as Tally
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer

from bench.capped_link import CappedObjects, Egress, Link
from bench.null_engine import NullEngine
from launcher.processes import TETHER, ManagedProcess, ProcessGroup, free_port

log = logging.getLogger(__name__)

RUN = "fleet"
MB = 1_000_000
CONVERGE_DEADLINE_S = 600.0
S3_CLIENTS = 8
# Agents start in waves of this many, each wave registered before the next starts (as an
# orchestrator rolls out replicas; all at once is a registration storm on a small machine).
START_WAVE = 50
TARGET_N = 10_000


@dataclass(frozen=True)
class FleetConfig:
    """One scale of the benchmark."""

    engines: int
    versions: int = 3
    model_kb: int = 512
    agent_link_mbps: float = 0.03
    store_egress_mbps: float = 0.3
    heartbeat_s: float = 2.0
    lease_s: float = 20.0
    threads: int = 256
    # Peer-assisted fetch (docs/peers.md): agents read version files from each other first,
    # each uploading at most its link's rate.
    peers: bool = False
    # Agents whose kept files are damaged right after each is saved: they serve peers
    # corrupted bytes (every `engines // bad_peers`-th agent, the first one included).
    bad_peers: int = 0
    # Agents pass a file on in pieces of this size while it arrives (cut-through): small
    # next to a version's files, as 8 MiB is next to a real shard.
    peer_chunk_bytes: int = 2048

    @property
    def caps(self) -> dict[str, float]:
        return {
            "agent_link_MBps": self.agent_link_mbps,
            "store_egress_MBps": self.store_egress_mbps,
        }


@dataclass
class Stack:
    """PostgreSQL, SeaweedFS S3 and one control plane, all stopped by `close`."""

    work: Path
    group: ProcessGroup
    postgres: Any = None
    seaweed: Any = None
    s3: Any = None
    controlplane: ManagedProcess | None = None
    url: str = ""
    store_url: str = ""
    admin: str = ""
    tokens: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, work: Path, config: FleetConfig) -> Stack:
        from launcher.postgres import PostgresServer
        from launcher.seaweed import SeaweedS3

        stack = cls(work, ProcessGroup(work / "logs"))
        stack.group.__enter__()
        try:
            stack.postgres = PostgresServer.create().start()
            db_url = stack.postgres.create_database("fleet")
            stack.seaweed = SeaweedS3.create(work / "seaweed")
            stack.s3 = stack.seaweed.start()
            stack.store_url = stack.s3.url("fleet")
            stack.admin = "tth_fleet-" + secrets.token_hex(16)
            port = free_port()
            stack.url = f"http://127.0.0.1:{port}"
            env = {
                "TETHER_ADMIN_TOKEN": stack.admin,
                "TETHER_LEASE_SECONDS": str(config.lease_s),
                "TETHER_HEARTBEAT_INTERVAL_S": str(config.heartbeat_s),
                **stack.s3.environment(),
            }
            stack.controlplane = stack.group.start(
                "controlplane",
                [TETHER, "controlplane", "serve", "--db", db_url, "--store", stack.store_url,
                 "--port", str(port), "--log-level", "warning"],
                env=env,
                url=stack.url,
            )  # fmt: skip
            stack.controlplane.wait_http("/readyz", deadline_s=120.0)
            for role in ("trainer", "engine"):
                reply = httpx.post(
                    f"{stack.url}/v1/tokens",
                    json={"role": role, "name": f"fleet-{role}"},
                    headers={"Authorization": f"Bearer {stack.admin}"},
                    timeout=30.0,
                )
                reply.raise_for_status()
                stack.tokens[role] = reply.json()["token"]
        except BaseException:
            stack.close()
            raise
        return stack

    def close(self) -> None:
        try:
            self.group.__exit__()
        finally:
            if self.seaweed is not None:
                self.seaweed.stop()
            if self.postgres is not None:
                self.postgres.remove()

    def controlplane_cpu_s(self) -> float:
        """CPU seconds (user + system) the control-plane process has used so far."""
        assert self.controlplane is not None
        return _process_cpu_s(self.controlplane.process.pid)


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime and stime are the 14th and 15th fields; the split starts at the 3rd.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Trainer:
    """Publishes the chain of synthetic versions into the store and tells the control plane."""

    def __init__(self, stack: Stack, config: FleetConfig) -> None:
        from store.store import Store
        from store.synthetic import random_checkpoint

        self.stack = stack
        self.store = Store(stack.store_url, storage_options=dict(stack.s3.storage_options))
        # Square BF16 tensors of 256 × 256 (128 KB each) up to the model size asked for.
        count = max(1, round(config.model_kb * 1024 / (256 * 256 * 2)))
        shapes = {f"model.layers.{i}.mlp.up_proj.weight": (256, 256) for i in range(count)}
        self.weights = random_checkpoint(seed=0, shapes=shapes)
        self.sizes: dict[int, int] = {}
        self.published_at: dict[int, float] = {}
        self.client = httpx.Client(
            base_url=stack.url,
            headers={"Authorization": f"Bearer {stack.tokens['trainer']}"},
            timeout=30.0,
        )

    def boot(self, folder: Path) -> None:
        """Create the run, publish v0 (FULL) and write it as the engines' boot folder."""
        from engine_agent.precision.checkpoint import write_safetensors_folder
        from store.torch_bridge import raw_to_state_dict

        run = self.store.create_run(RUN, boot_version=0)
        reply = self.client.post(
            "/v1/runs",
            json={"run_id": RUN, "store_url": self.store.url, "boot_version": run.boot_version,
                  "canonical_dtype": run.canonical_dtype, "base_checkpoint": None},
        )  # fmt: skip
        reply.raise_for_status()
        self._publish(0, None)
        write_safetensors_folder(folder, raw_to_state_dict(self.weights))
        (folder / "config.json").write_text(json.dumps({"architectures": ["NullForBench"]}))

    def publish_next(self) -> int:
        """Publish a small training-like update of the last version; return its number."""
        from store.synthetic import small_update

        version = max(self.sizes) + 1
        base = self.weights
        self.weights = small_update(base, seed=version)
        self._publish(version, base)
        return version

    def _publish(self, version: int, base: Any) -> None:
        from store.codecs import encode_version
        from store.types import VersionRef

        files = encode_version(
            self.weights,
            base,
            version=version,
            base_version=None if base is None else version - 1,
            codec="full" if base is None else "sparse",
        )
        self.store.publish(VersionRef(RUN, version), files)
        self.sizes[version] = sum(len(data) for data in files.values())
        self.published_at[version] = time.time()
        reply = self.client.post(f"/v1/runs/{RUN}/versions", json={"version": version})
        reply.raise_for_status()

    def convergence(self, version: int) -> dict[str, Any]:
        """The control plane's own record of how `version` spread (its SLO figures)."""
        reply = self.client.get(f"/v1/runs/{RUN}/versions/{version}/convergence")
        reply.raise_for_status()
        run: dict[str, Any] = reply.json()["run"]
        return run

    def close(self) -> None:
        self.client.close()


class Probes:
    """What the agents' HTTP clients see: heartbeat round trips and long-poll wake-ups."""

    def __init__(self) -> None:
        self.heartbeat_s: list[float] = []
        # version → wall times at which a target long-poll handed an agent that version.
        self.woken: dict[int, list[float]] = {}
        self.loop_lag_s: list[float] = []
        self.recording = False

    def hooks(self) -> dict[str, list[Any]]:
        return {"request": [self._sent], "response": [self._answered]}

    async def _sent(self, request: httpx.Request) -> None:
        request.extensions["fleet_sent"] = time.perf_counter()

    async def _answered(self, response: httpx.Response) -> None:
        path = response.request.url.path
        sent = response.request.extensions.get("fleet_sent")
        if path.endswith("/heartbeat") and sent is not None and self.recording:
            self.heartbeat_s.append(time.perf_counter() - sent)
        elif path.endswith("/target") and response.status_code == 200:
            await response.aread()
            reply = response.json()
            target = reply.get("target_version")
            if reply.get("changed") and target is not None:
                self.woken.setdefault(int(target), []).append(time.time())


class Swarm:
    """N agents in this process, each with a null engine, a capped link and its own ports."""

    def __init__(self, stack: Stack, config: FleetConfig, boot: Path, work: Path) -> None:
        from store.objects import open_objects

        self.stack = stack
        self.config = config
        self.boot = boot
        self.work = work
        # A few S3 clients for the whole swarm (boto3 keeps 10 connections each): one per
        # agent would cost more memory and start-up time than the agent itself. Each agent
        # still has its own capped link.
        self.objects = [
            open_objects(stack.store_url, dict(stack.s3.storage_options)) for _ in range(S3_CLIENTS)
        ]
        self.store_link = Link(config.store_egress_mbps * MB)
        self.egress = Egress()
        self.probes = Probes()
        self.engines: list[NullEngine] = []
        self.agents: list[Any] = []
        self.tasks: list[asyncio.Task[int]] = []
        self.changed = asyncio.Event()

    def _committed(self, _version: int) -> None:
        self.changed.set()

    def add(self, count: int) -> None:
        from engine_agent.agent import Agent
        from engine_agent.control_client import ControlClient
        from engine_agent.settings import AgentSettings
        from store.store import Store
        from wire import Precision

        for _ in range(count):
            index = len(self.agents)
            settings = AgentSettings(
                engine_url="http://127.0.0.1:9",
                precision=Precision.BF16,
                run=RUN,
                store=self.stack.store_url,
                control_plane=self.stack.url,
                token=self.stack.tokens["engine"],
                boot_model=self.boot,
                boot_version=0,
                work_dir=self.work / f"agent-{index}",
                engine_probe_s=5.0,
                long_poll_s=20.0,
                retry_initial_s=0.2,
                retry_max_s=2.0,
                peer_fetch=self.config.peers,
                peer_upload_bytes_per_s=self.config.agent_link_mbps * MB,
                peer_chunk_bytes=self.config.peer_chunk_bytes,
            )
            engine = NullEngine(f"engine-{index}", 0, self._committed)
            link = Link(self.config.agent_link_mbps * MB)
            inner = self.objects[index % len(self.objects)]
            capped = CappedObjects(inner, link, self.store_link, self.egress)
            # With peer fetch the agent keeps what it fetched, verified, to serve it.
            cache = self.work / f"agent-{index}" / "peer-files" if self.config.peers else None
            store = Store(inner.url, objects=capped, cache_dir=cache)
            control = ControlClient(
                settings.control_planes, settings.token, event_hooks=self.probes.hooks()
            )
            agent = Agent(settings, engine, store=store, control=control)
            if (
                self.config.bad_peers
                and index % max(1, self.config.engines // self.config.bad_peers) == 0
            ):
                _serve_damaged(agent)
            self.engines.append(engine)
            self.agents.append(agent)
            self.tasks.append(asyncio.create_task(agent.run(), name=f"agent-{index}"))

    def serving(self, version: int) -> int:
        return sum(1 for e in self.engines if int(e.label) >= version)

    async def wait_serving(self, version: int, count: int, deadline_s: float) -> None:
        """Until `count` engines serve `version` (or newer); raise past the deadline."""
        deadline = time.monotonic() + deadline_s
        while self.serving(version) < count:
            for task in self.tasks:
                if task.done():
                    raise RuntimeError(f"{task.get_name()} exited with {task.result()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.serving(version)}/{count} engines serve v{version} after "
                    f"{deadline_s:.0f}s"
                )
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))

    async def wait_registered(self, count: int, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while sum(1 for a in self.agents if a.engine_id is not None) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} agents registered in {deadline_s:.0f}s")
            await asyncio.sleep(0.1)

    def reached(self, version: int, published_at: float) -> list[float]:
        """Seconds from publication until each engine first committed `version` or newer."""
        times = []
        for engine in self.engines:
            first = next((t for v, t in engine.commits if v >= version), None)
            if first is not None:
                times.append(max(0.0, first - published_at))
        return sorted(times)

    def differing(self) -> int:
        """Commits whose staged weights differ from the most common ones of that version."""
        by_version: dict[int, Tally[str]] = {}
        for engine in self.engines:
            for version, digest in engine.digests.items():
                by_version.setdefault(version, Tally())[digest] += 1
        return sum(sum(t.values()) - max(t.values()) for t in by_version.values())

    async def close(self) -> None:
        for agent in self.agents:
            agent.stop()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _serve_damaged(agent: Any) -> None:
    """Damage each file the agent keeps for its peers as soon as it is saved, and every byte
    it forwards while a file arrives (the agent's own catch-up already holds the good bytes),
    so every peer that reads from it gets bad ones."""
    cache = agent.store.cache
    if cache is None:
        return
    serve = cache.on_saved
    receive = cache.receive

    def damaged_receive(key: str, size: int) -> Any:
        partial = receive(key, size)
        write = partial.write
        partial.write = lambda chunk: write(bytes(b ^ 0x5A for b in chunk))
        return partial

    cache.receive = damaged_receive

    def damage(key: str) -> None:
        path = cache.root / key
        data = path.read_bytes()
        path.write_bytes(bytes(b ^ 0x5A for b in data[:256]) + data[256:])
        if serve is not None:
            serve(key)

    cache.on_saved = damage


def _stop_on_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Ctrl-C / SIGTERM end the measurement (and stop every server): each agent installs
    its own handlers when it starts, so the bench takes them back after each wave."""
    main = asyncio.current_task()
    assert main is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)


async def _loop_lag(out: list[float], period_s: float = 0.1) -> None:
    """Record how much later than asked each `period_s` sleep of this loop ends."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(period_s)
        out.append(max(0.0, time.perf_counter() - asked - period_s))


def fraction_time(times: list[float], total: int, fraction: float) -> float | None:
    """Seconds until `fraction` of `total` engines got there (None if they never did)."""
    needed = max(1, math.ceil(fraction * total - 1e-9))
    return times[needed - 1] if len(times) >= needed else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def _measure(config: FleetConfig, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    # Fetches run on worker threads and a capped link holds its thread: enough threads
    # that the caps, not the pool, bound how many agents fetch at once.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=config.threads))
    stack = await asyncio.to_thread(Stack.start, work, config)
    trainer: Trainer | None = None
    swarm: Swarm | None = None
    try:
        trainer = Trainer(stack, config)
        boot = work / "boot"
        await asyncio.to_thread(trainer.boot, boot)
        swarm = Swarm(stack, config, boot, work / "agents")
        # The single-engine catch-up under the same caps: one agent alone on v1.
        swarm.add(1)
        await swarm.wait_registered(1, 120.0)
        _stop_on_signals(loop)
        v1 = await asyncio.to_thread(trainer.publish_next)
        await swarm.wait_serving(v1, 1, CONVERGE_DEADLINE_S)
        single_s = swarm.reached(v1, trainer.published_at[v1])[0]
        say(f"single engine catches up on v{v1} ({trainer.sizes[v1]} B) in {single_s:.3f}s")
        started = time.perf_counter()
        while len(swarm.agents) < config.engines:
            swarm.add(min(START_WAVE, config.engines - len(swarm.agents)))
            await swarm.wait_registered(len(swarm.agents), 300.0)
            _stop_on_signals(loop)
        await swarm.wait_serving(v1, config.engines, CONVERGE_DEADLINE_S)
        say(f"{config.engines} agents up and on v{v1} in {time.perf_counter() - started:.1f}s")
        rows = []
        swarm.probes.recording = True
        lag_probe = asyncio.create_task(_loop_lag(swarm.probes.loop_lag_s), name="loop lag")
        cpu0, wall0, own0 = stack.controlplane_cpu_s(), time.perf_counter(), time.process_time()
        for _ in range(config.versions):
            egress0 = swarm.egress.bytes
            version = await asyncio.to_thread(trainer.publish_next)
            published = trainer.published_at[version]
            await swarm.wait_serving(version, config.engines, CONVERGE_DEADLINE_S)
            times = swarm.reached(version, published)
            seen = await asyncio.to_thread(trainer.convergence, version)
            woken = [t - published for t in swarm.probes.woken.get(version, [])]
            row: dict[str, Any] = {
                "version": version,
                "version_bytes": trainer.sizes[version],
                **{f"t{int(f * 100)}_s": fraction_time(times, config.engines, f)
                   for f in (0.5, 0.9, 0.99, 1.0)},
                "store_egress_bytes": swarm.egress.bytes - egress0,
                "wake_p50_s": percentile(woken, 0.5),
                "wake_p99_s": percentile(woken, 0.99),
                "woken": len(woken),
                # The control plane's view (GET .../convergence): its snapshots' times and
                # the bytes the agents' heartbeats reported.
                "cp_t99_s": seen["t99_s"],
                "cp_store_bytes": seen["store_bytes"],
                "cp_peer_bytes": seen["peer_bytes"],
            }  # fmt: skip
            rows.append(row)
            say(
                f"v{version}: 50% {row['t50_s']:.2f}s  90% {row['t90_s']:.2f}s  "
                f"99% {row['t99_s']:.2f}s  100% {row['t100_s']:.2f}s  "
                f"store egress {row['store_egress_bytes'] / row['version_bytes']:.1f}× "
                f"the version"
            )
        wall = time.perf_counter() - wall0
        cp_cpu = stack.controlplane_cpu_s() - cpu0
        own_cpu = time.process_time() - own0
        swarm.probes.recording = False
        lag_probe.cancel()
        wakes = [t - trainer.published_at[r["version"]] for r in rows
                 for t in swarm.probes.woken.get(r["version"], [])]  # fmt: skip
        beats = swarm.probes.heartbeat_s

        def mean(key: str) -> float:
            return sum(r[key] for r in rows) / len(rows)

        p99 = mean("t99_s")
        differing = swarm.differing()
        return {
            "engines": config.engines,
            "versions": config.versions,
            "version_bytes": round(mean("version_bytes")),
            "caps": config.caps,
            "heartbeat_interval_s": config.heartbeat_s,
            "single_catchup_s": round(single_s, 4),
            "converged_p50_s": round(mean("t50_s"), 4),
            "converged_p90_s": round(mean("t90_s"), 4),
            "converged_p99_s": round(p99, 4),
            "converged_p100_s": round(mean("t100_s"), 4),
            "converged_p99_over_single": round(p99 / single_s, 3) if single_s > 0 else None,
            "store_egress_over_version_bytes": round(
                sum(r["store_egress_bytes"] for r in rows) / sum(r["version_bytes"] for r in rows),
                3,
            ),
            "peer_bytes": sum(a.status.fetched_bytes.get("peer", 0) for a in swarm.agents),
            "store_bytes": sum(a.status.fetched_bytes.get("store", 0) for a in swarm.agents),
            # Bytes a source served that failed verification (thrown away), and the sources
            # dropped by reason (digest, size, stall, error, unavailable).
            "rejected_bytes": sum(a.status.rejected_bytes for a in swarm.agents),
            "source_faults": dict(
                sum((Tally(a.status.source_faults) for a in swarm.agents), Tally())
            ),
            # Engines whose staged weights for a version differ from the others' (the
            # store's bytes, verified): any byte of a bad peer that got through shows here.
            "commits_differing": differing,
            "bad_peer_bytes_used": 0 if differing == 0 else None,
            "heartbeats": len(beats),
            "heartbeat_p50_ms": _ms(percentile(beats, 0.5)),
            "heartbeat_p99_ms": _ms(percentile(beats, 0.99)),
            "wake_p50_ms": _ms(percentile(wakes, 0.5)),
            "wake_p99_ms": _ms(percentile(wakes, 0.99)),
            "controlplane_cpu_cores": round(cp_cpu / wall, 3),
            "swarm_cpu_cores": round(own_cpu / wall, 3),
            # How late the swarm's own event loop wakes (a 100 ms sleep's overshoot): the
            # part of every latency above that is this process's, not the control plane's.
            "swarm_loop_lag_p50_ms": _ms(percentile(swarm.probes.loop_lag_s, 0.5)),
            "swarm_loop_lag_p99_ms": _ms(percentile(swarm.probes.loop_lag_s, 0.99)),
            # Reconcile passes that failed and were retried (timeouts on a starved machine),
            # by error type: each re-reads its versions from the store.
            "failed_passes": dict(sum((Tally(a.status.failures) for a in swarm.agents), Tally())),
            "per_version": rows,
        }
    finally:
        if swarm is not None:
            await swarm.close()
        if trainer is not None:
            trainer.close()
        await asyncio.to_thread(stack.close)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def measure(config: FleetConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """One scale on a fresh stack in a temporary folder (removed afterwards)."""
    work = Path(tempfile.mkdtemp(prefix="tether-bench-fleet-"))
    try:
        return asyncio.run(_measure(config, work, say))
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None  # a signal ended it (after the cleanup)
    except Exception:
        # Keep the servers' logs of a failed scale: they say what gave way.
        kept = Path(tempfile.mkdtemp(prefix="tether-bench-fleet-logs-"))
        shutil.copytree(work / "logs", kept / "logs", dirs_exist_ok=True)
        say(f"the servers' logs are kept in {kept}")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class Fit:
    """t(N) = a + b·g(N) by least squares, g = N (linear) or log2 N (tree)."""

    form: str
    a: float
    b: float
    max_rel_error: float

    def predict(self, n: float) -> float:
        return self.a + self.b * _basis(self.form, n)

    def as_dict(self) -> dict[str, Any]:
        g = "N" if self.form == "linear" else "log2(N)"
        return {
            "form": f"t = {self.a:.4g} + {self.b:.4g}·{g}",
            "max_rel_error_on_measured": round(self.max_rel_error, 4),
            f"predicted_{TARGET_N}_s": round(self.predict(TARGET_N), 3),
        }


def _basis(form: str, n: float) -> float:
    return n if form == "linear" else math.log2(n)


def fit(points: list[tuple[int, float]], form: str) -> Fit:
    """Least-squares fit of `form` to (engines, seconds) points (one point: b = 0)."""
    xs = [_basis(form, n) for n, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    a = my - b * mx
    errors = [abs(a + b * x - y) / y for x, y in zip(xs, ys, strict=True) if y > 0]
    return Fit(form, a, b, max(errors, default=0.0))


def models(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Both fits of the time to 99 % over the measured scales, and the better one's
    prediction for `TARGET_N` engines."""
    points = [(r["engines"], r["converged_p99_s"]) for r in results]
    fits = [fit(points, "linear"), fit(points, "log")]
    best = min(fits, key=lambda f: f.max_rel_error)
    return {
        "converged_p99": {f.form: f.as_dict() for f in fits},
        "converged_p99_best": best.form,
        f"converged_p99_predicted_{TARGET_N}_s": round(best.predict(TARGET_N), 3),
    }


def run(
    engines: list[int] = typer.Option([100], help="fleet sizes to run, each on a fresh stack"),
    versions: int = typer.Option(3, help="versions published (one at a time) per scale"),
    model_kb: int = typer.Option(512, help="size of the synthetic BF16 model in KiB"),
    agent_link_mbps: float = typer.Option(0.03, help="each agent's link in MB/s"),
    store_egress_mbps: float = typer.Option(0.3, help="the store's egress in MB/s"),
    heartbeat_s: float = typer.Option(5.0, help="heartbeat interval the control plane asks"),
    threads: int = typer.Option(256, help="fetch worker threads in the swarm process"),
    peers: bool = typer.Option(False, help="peer-assisted fetch between the agents"),
    bad_peers: int = typer.Option(0, help="agents that serve their peers damaged files"),
) -> None:
    """A swarm of real agents with null engines: convergence, store egress, heartbeats."""
    logging.basicConfig(level=logging.WARNING)
    # A full boto3 pool is expected with hundreds of fetch threads; it is not news.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    results: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for n in engines:
        config = FleetConfig(
            engines=n, versions=versions, model_kb=model_kb, agent_link_mbps=agent_link_mbps,
            store_egress_mbps=store_egress_mbps, heartbeat_s=heartbeat_s,
            lease_s=max(10.0, heartbeat_s * 5), threads=threads, peers=peers,
            bad_peers=bad_peers,
        )  # fmt: skip
        print(f"--- {n} engines, caps {config.caps}, load {os.getloadavg()[0]:.2f}")
        try:
            result = measure(config)
        except Exception as exc:  # a scale the machine cannot hold: say why, go on
            failures.append({"engines": n, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"{n} engines: failed: {failures[-1]['error']}")
            continue
        results.append(result)
        print(
            f"{n} engines: 99% in {result['converged_p99_s']:.2f}s = "
            f"{result['converged_p99_over_single']}× one engine ({result['single_catchup_s']:.2f}s)"
            f"; store egress {result['store_egress_over_version_bytes']}× the version; "
            f"heartbeat p99 {result['heartbeat_p99_ms']} ms; wake p99 {result['wake_p99_ms']} ms;"
            f" control plane {result['controlplane_cpu_cores']} cores"
        )
    if not results:
        print(json.dumps({"engines": 0, "failed": failures}))
        raise typer.Exit(1)
    summary = {k: v for k, v in results[-1].items() if k != "per_version"}
    summary["failed"] = failures
    summary["scales"] = [{k: v for k, v in r.items() if k != "per_version"} for r in results]
    if len(results) > 1:
        summary["model"] = models(results)
        for form, described in summary["model"]["converged_p99"].items():
            print(f"model ({form}): {described}")
    summary["load_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    typer.run(run)
