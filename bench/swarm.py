"""The fleet benchmark's swarm: real engine agents spread over several worker processes.

Owns running the agents of `tether bench fleet`: `SwarmPool` (in the bench's process)
starts K worker processes and gathers what they report; each worker (`serve_share`) runs
its share of the agents on its own event loop (uvloop when installed) with one fetch thread
pool for all of them. Every agent is the real `engine_agent.agent.Agent` (reconciler,
fetch, fold, verify, staging, commit; heartbeats and target long-polls over real HTTP; its
proxy and peer server on its own port) with a `NullEngine`, reading the store through its
own capped link and the store's egress link, which every process shares. A worker starts
its agents at a steady rate without waiting for any to register, and reports each
registration, commit (version, wall time, staged-weights digest) and long-poll wake-up as
it happens; when asked to stop, its heartbeat round trips, event-loop lag, CPU and the
agents' fetch counters. Never publishes versions, never starts servers, never asserts.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import multiprocessing
import queue
import resource
import signal
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

from bench.capped_link import CappedObjects, Egress, Link, SharedLink
from bench.null_engine import NullEngine
from runtime import collector
from store.codecs.warm import warm_decoders

log = logging.getLogger(__name__)

MB = 1_000_000
# A few S3 clients per process (boto3 keeps 10 connections each): one per agent would cost
# more memory and start-up time than the agent itself. Each agent still has its own link.
S3_CLIENTS = 4
WATCH_S = 0.2
WARM_IMPORTS = (
    "engine_agent.agent",
    "engine_agent.precision.checkpoint",
    "engine_agent.precision.incremental",
    "store.codecs",
    "store.torch_bridge",
)


@dataclass(frozen=True)
class SwarmSpec:
    """What every worker needs to build its agents (pickled to each worker at start)."""

    engines: int
    run: str
    control_plane: str
    engine_token: str
    store_url: str
    storage_options: dict[str, Any]
    boot: Path
    work: Path
    agent_link_mbps: float
    threads: int
    # Agents started per second (the whole swarm's; each worker takes its part).
    start_per_s: float
    peers: bool = False
    bad_peers: int = 0
    peer_chunk_bytes: int = 2048
    # Settle the cycle collector when the measurement starts (`FleetConfig.settle_gc`).
    settle_gc: bool = False

    def lies(self, index: int) -> bool:
        """Whether agent `index` serves its peers damaged files (every
        `engines // bad_peers`-th agent, the first one included)."""
        return bool(self.bad_peers) and index % max(1, self.engines // self.bad_peers) == 0


# ---- the bench's side ------------------------------------------------------------------


class SwarmPool:
    """K worker processes holding the agents (agent i lives in worker i mod K), and what
    they reported: registrations, commits, wake-ups and, once stopped, their summaries."""

    def __init__(self, spec: SwarmSpec, procs: int, store_egress_mbps: float) -> None:
        context = multiprocessing.get_context("spawn")
        # Each worker starts its share at its part of the swarm's rate.
        spec = replace(spec, start_per_s=spec.start_per_s / procs)
        self.spec = spec
        self.store_link = SharedLink(store_egress_mbps * MB, context)
        self.egress = Egress(context)
        self._events: Queue[tuple[Any, ...]] = context.Queue()
        self._commands: list[Queue[tuple[Any, ...]]] = [context.Queue() for _ in range(procs)]
        self.ready: set[int] = set()
        self.registered: set[int] = set()
        self.applied: dict[int, int] = {}
        self.commits: dict[int, list[tuple[int, float]]] = {}
        self.digests: dict[int, dict[int, str]] = {}
        self.woken: dict[int, list[float]] = {}
        self.summaries: dict[int, dict[str, Any]] = {}
        pipes = [Pipes(self.store_link, self.egress, c, self._events) for c in self._commands]
        self.processes: list[BaseProcess] = [
            context.Process(
                target=serve_share,
                args=(k, spec, pipes[k]),
                name=f"swarm-{k}",
                daemon=True,
            )
            for k in range(procs)
        ]
        try:
            for process in self.processes:
                process.start()
            self.wait_until(
                lambda: len(self.ready) == procs,
                120.0,
                lambda: f"{len(self.ready)}/{procs} swarm processes ready",
            )
        except BaseException:
            self.close()
            raise

    def add(self, indices: range | list[int]) -> None:
        """Start agents `indices`, each in its worker (they start at the spec's rate)."""
        shares: dict[int, list[int]] = {}
        for index in indices:
            shares.setdefault(index % len(self.processes), []).append(index)
        for worker, share in shares.items():
            self._commands[worker].put(("add", share))

    def record(self, on: bool) -> None:
        """Start (or stop) the measurement window of heartbeats, loop lag and CPU."""
        for commands in self._commands:
            commands.put(("record", on))

    def speed_up(self, factor: float) -> None:
        """Run every link (the agents', their peer uploads and the store's egress) at
        `factor` times its cap from now on, agents started later included; 1 restores
        the caps. For a phase the bench does not measure (the fleet's first catch-up)."""
        self.store_link.factor = factor
        for commands in self._commands:
            commands.put(("speed", factor))

    def serving(self, version: int) -> int:
        return sum(1 for v in self.applied.values() if v >= version)

    def wait_serving(self, version: int, count: int, deadline_s: float) -> None:
        """Until `count` engines serve `version` (or newer)."""
        self.wait_until(
            lambda: self.serving(version) >= count,
            deadline_s,
            lambda: f"{self.serving(version)}/{count} engines serve v{version}",
        )

    def reached(self, version: int, published_at: float) -> list[float]:
        """Seconds from publication until each engine first committed `version` or newer."""
        times = []
        for commits in self.commits.values():
            first = next((t for v, t in commits if v >= version), None)
            if first is not None:
                times.append(max(0.0, first - published_at))
        return sorted(times)

    def differing(self) -> int:
        """Commits whose staged weights differ from the most common ones of that version."""
        by_version: dict[int, Tally[str]] = {}
        for digests in self.digests.values():
            for version, digest in digests.items():
                by_version.setdefault(version, Tally())[digest] += 1
        return sum(sum(t.values()) - max(t.values()) for t in by_version.values())

    def wait_until(
        self, done: Callable[[], bool], deadline_s: float, progress: Callable[[], str]
    ) -> None:
        """Take in reports until `done()`; TimeoutError (saying `progress()`) past the
        deadline, RuntimeError when a worker or an agent failed."""
        deadline = time.monotonic() + deadline_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{progress()} after {deadline_s:.0f}s")
            self._pump(min(left, 0.5))

    def _pump(self, timeout_s: float) -> None:
        try:
            event = self._events.get(timeout=timeout_s)
        except queue.Empty:
            event = None
        if event is None:
            for k, process in enumerate(self.processes):
                if process.exitcode is not None and k not in self.summaries:
                    raise RuntimeError(f"swarm worker {k} exited with {process.exitcode}")
            return
        while True:
            self._take(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _take(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "commit":
            _, index, version, at, digest = event
            self.applied[index] = max(version, self.applied.get(index, version))
            self.commits.setdefault(index, []).append((version, at))
            self.digests.setdefault(index, {})[version] = digest
        elif kind == "woken":
            self.woken.setdefault(event[1], []).append(event[2])
        elif kind == "registered":
            self.registered.add(event[1])
        elif kind == "ready":
            self.ready.add(event[1])
        elif kind == "summary":
            self.summaries[event[1]] = event[2]
        elif kind == "exited":
            raise RuntimeError(f"agent-{event[1]} exited with {event[2]}")
        elif kind == "error":
            raise RuntimeError(f"swarm worker {event[1]} failed: {event[2]}")

    def stop(self, deadline_s: float = 120.0) -> list[dict[str, Any]]:
        """Stop every agent (each deregisters) and return the workers' summaries."""
        for commands in self._commands:
            commands.put(("stop",))
        self.wait_until(
            lambda: len(self.summaries) == len(self.processes),
            deadline_s,
            lambda: f"{len(self.summaries)}/{len(self.processes)} swarm workers stopped",
        )
        return [self.summaries[k] for k in sorted(self.summaries)]

    def close(self) -> None:
        """End every worker still running (politely first)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            if process.pid is None:
                continue
            process.join(10.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)


# ---- a worker's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Pipes:
    """What a worker shares with the bench: the store's link and egress counter, its own
    command queue and the event queue of all workers (handed over at the worker's start)."""

    store_link: SharedLink
    egress: Egress
    commands: Queue[tuple[Any, ...]]
    events: Queue[tuple[Any, ...]]


def serve_share(worker: int, spec: SwarmSpec, pipes: Pipes) -> None:
    """A worker process's body: run agents as the bench asks until it says stop."""
    logging.basicConfig(
        level=logging.WARNING, format=f"swarm-{worker} %(levelname)s %(name)s: %(message)s"
    )
    # A full boto3 pool is expected with hundreds of fetch threads; it is not news.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    # Ctrl-C reaches the whole process group: the bench decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(worker, spec, pipes))
    except BaseException as exc:
        pipes.events.put(("error", worker, f"{type(exc).__name__}: {exc}"[:500]))
        raise


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(worker: int, spec: SwarmSpec, pipes: Pipes) -> None:
    commands, events = pipes.commands, pipes.events
    loop = asyncio.get_running_loop()
    # Fetches run on worker threads and a capped link holds its thread: enough threads
    # that the caps, not the pool, bound how many agents fetch at once. One pool for all
    # the agents of this process (their `asyncio.to_thread`), never one per agent.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=spec.threads))
    share = Share(spec, pipes.store_link, pipes.egress, events.put)
    collector.PauseObserver(share.gc_paused).install()
    # Once for all the agents of this process, as each real agent does while its engine
    # loads (`AgentSettings.warm_codecs`): no first catch-up here loads the codecs' kernels.
    warm_decoders()
    stopping = asyncio.Event()

    def terminate() -> None:  # SIGTERM (the bench closing its workers): stop as asked to
        commands.put(("stop",))

    background = [
        asyncio.create_task(share.watch(stopping, terminate), name="watch"),
        asyncio.create_task(_loop_lag(share), name="loop lag"),
    ]
    events.put(("ready", worker))
    try:
        while True:
            command = await asyncio.to_thread(commands.get)
            if command[0] == "add":
                background.append(asyncio.create_task(share.start(command[1]), name="start"))
            elif command[0] == "record":
                share.record(command[1])
            elif command[0] == "speed":
                share.speed_up(command[1])
            elif command[0] == "stop":
                break
    finally:
        stopping.set()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await share.close()
    events.put(("summary", worker, share.summary()))


class Share:
    """One worker's agents, each with a null engine, a capped link and its own ports."""

    def __init__(
        self,
        spec: SwarmSpec,
        store_link: SharedLink,
        egress: Egress,
        report: Callable[[tuple[Any, ...]], None],
    ) -> None:
        # What every agent runs (its lazy imports too: torch, the codecs), imported before
        # the worker says it is ready, so the first agent of each worker starts and catches
        # up as fast as the others (the single-engine time is one worker's first agent).
        for module in WARM_IMPORTS:
            importlib.import_module(module)
        from store.objects import open_objects

        self.spec = spec
        self.store_link = store_link
        self.egress = egress
        self.report = report
        self.objects = [
            open_objects(spec.store_url, dict(spec.storage_options)) for _ in range(S3_CLIENTS)
        ]
        self.agents: dict[int, Any] = {}
        self.links: dict[int, Link] = {}
        # What `speed_up` last asked: the links of agents started later get it too.
        self.factor = 1.0
        self.tasks: dict[int, asyncio.Task[int]] = {}
        self._announced: set[int] = set()
        self._base_settings: Any = None
        self.recording = False
        self.heartbeat_s: list[float] = []
        self.loop_lag_s: list[float] = []
        self.gc_pause_s: list[float] = []
        self._settled = False
        self._cpu = 0.0
        self._cpu_from: float | None = None

    def gc_paused(self, seconds: float) -> None:
        if self.recording:
            self.gc_pause_s.append(seconds)

    def record(self, on: bool) -> None:
        if on and self.spec.settle_gc and not self._settled:
            # Every agent is up: what exists now is never scanned again, and collections
            # come far apart (`runtime.collector`).
            collector.settle()
            self._settled = True
        if on and self._cpu_from is None:
            self._cpu_from = time.process_time()
        elif not on and self._cpu_from is not None:
            self._cpu += time.process_time() - self._cpu_from
            self._cpu_from = None
        self.recording = on

    def speed_up(self, factor: float) -> None:
        self.factor = factor
        for index, agent in self.agents.items():
            self._speed(index, agent)

    def _speed(self, index: int, agent: Any) -> None:
        self.links[index].factor = self.factor
        if agent.peer_server is not None:
            agent.peer_server.limiter.bytes_per_s = self.spec.agent_link_mbps * MB * self.factor

    async def start(self, indices: list[int]) -> None:
        """Start the agents at the spec's rate (this process's part of it), never waiting
        for one to register: a slow one holds up nobody, and their heartbeats start spread
        over the ramp instead of in lockstep."""
        per_s = max(1e-3, self.spec.start_per_s)
        began = time.monotonic()
        for n, index in enumerate(indices):
            try:
                self.add(index)
            except Exception as exc:  # e.g. out of ports or files: the bench must hear it
                self.report(("exited", index, f"could not start: {exc!r}"))
                return
            wait = began + (n + 1) / per_s - time.monotonic()
            await asyncio.sleep(max(0.0, wait))

    def add(self, index: int) -> None:
        from engine_agent.agent import Agent
        from engine_agent.control_client import ControlClient
        from store.store import Store

        spec = self.spec
        work = spec.work / f"agent-{index}"
        settings = self._settings().model_copy(update={"work_dir": work})
        report = self.report

        def committed(version: int) -> None:
            at = engine.commits[-1][1]
            report(("commit", index, version, at, engine.digests[version]))

        engine = NullEngine(f"engine-{index}", 0, committed)
        link = Link(spec.agent_link_mbps * MB)
        inner = self.objects[index % len(self.objects)]
        capped = CappedObjects(inner, link, self.store_link, self.egress)
        # With peer fetch the agent keeps what it fetched, verified, to serve it.
        cache = work / "peer-files" if spec.peers else None
        store = Store(inner.url, objects=capped, cache_dir=cache)
        control = ControlClient(settings.control_planes, settings.token, on_answer=self._answered)
        agent = Agent(settings, engine, store=store, control=control)
        if spec.lies(index):
            _serve_damaged(agent)
        self.agents[index] = agent
        self.links[index] = link
        self._speed(index, agent)
        self.tasks[index] = asyncio.create_task(agent.run(), name=f"agent-{index}")

    def _settings(self) -> Any:
        """The agents' settings but for the work dir, read once: building them reads the
        environment and .env files (about 30 ms of the event loop's time per agent)."""
        if self._base_settings is None:
            from engine_agent.settings import AgentSettings
            from wire import Precision

            spec = self.spec
            self._base_settings = AgentSettings(
                engine_url="http://127.0.0.1:9",
                precision=Precision.BF16,
                run=spec.run,
                store=spec.store_url,
                control_plane=spec.control_plane,
                token=spec.engine_token,
                boot_model=spec.boot,
                boot_version=0,
                work_dir=spec.work,
                engine_probe_s=5.0,
                long_poll_s=20.0,
                retry_initial_s=0.2,
                retry_max_s=2.0,
                peer_fetch=spec.peers,
                peer_upload_bytes_per_s=spec.agent_link_mbps * MB,
                peer_chunk_bytes=spec.peer_chunk_bytes,
                # The agents' floor (1 MiB/s) is for real links: a capped link is slower. A
                # healthy transfer here gets at least a parent's capped upload shared by its
                # upload slots (8); half of that is the floor, so only a real stall trips it.
                peer_min_bytes_per_s=min(float(1 << 20), spec.agent_link_mbps * MB / 16),
                # A worker hosts many agents: its collector is settled once, for all of
                # them, when the measurement starts (`record`), not by each agent's boot.
                gc_settle=False,
                # Warmed once per worker too (`_serve`), not 0.3 s of CPU per agent.
                warm_codecs=False,
            )
        return self._base_settings

    def _answered(self, method: str, path: str, status: int, seconds: float, body: bytes) -> None:
        """Every control-plane answer an agent gets: heartbeat round trips, and each
        long-poll that came back with a new target (a wake-up)."""
        if path.endswith("/heartbeat") and self.recording:
            self.heartbeat_s.append(seconds)
        elif path.endswith("/target") and status == 200:
            reply = json.loads(body)
            target = reply.get("target_version")
            if reply.get("changed") and target is not None:
                self.report(("woken", int(target), time.time()))

    async def watch(self, stopping: asyncio.Event, terminate: Callable[[], None]) -> None:
        """Report registrations and agents that exited; take the signals back from the
        agents (each installs its own handlers when it starts)."""
        loop = asyncio.get_running_loop()
        while not stopping.is_set():
            for index, agent in self.agents.items():
                if index not in self._announced and agent.engine_id is not None:
                    self._announced.add(index)
                    self.report(("registered", index))
            for index, task in self.tasks.items():
                if task.done() and not stopping.is_set():
                    code = "cancelled" if task.cancelled() else task.exception() or task.result()
                    self.report(("exited", index, repr(code)))
                    return
            loop.add_signal_handler(signal.SIGINT, lambda: None)
            loop.add_signal_handler(signal.SIGTERM, terminate)
            await asyncio.sleep(WATCH_S)

    async def close(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def summary(self) -> dict[str, Any]:
        self.record(False)
        statuses = [a.status for a in self.agents.values()]
        return {
            "agents": len(self.agents),
            # Peak resident memory (KiB) and threads now: per agent, what a fleet costs.
            "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "threads": threading.active_count(),
            "heartbeat_s": self.heartbeat_s,
            "loop_lag_s": self.loop_lag_s,
            "gc_pause_s": self.gc_pause_s,
            "cpu_s": self._cpu,
            "peer_bytes": sum(s.fetched_bytes.get("peer", 0) for s in statuses),
            "store_bytes": sum(s.fetched_bytes.get("store", 0) for s in statuses),
            "rejected_bytes": sum(s.rejected_bytes for s in statuses),
            "source_faults": dict(sum((Tally(s.source_faults) for s in statuses), Tally())),
            "failures": dict(sum((Tally(s.failures) for s in statuses), Tally())),
        }


async def _loop_lag(share: Share, period_s: float = 0.1) -> None:
    """Record how much later than asked each `period_s` sleep of this loop ends."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(period_s)
        if share.recording:
            share.loop_lag_s.append(max(0.0, time.perf_counter() - asked - period_s))


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
