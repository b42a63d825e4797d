"""`tether bench fleet`: a swarm of real engine agents catching up on a chain of versions.

Starts its own PostgreSQL (`launcher.postgres`), SeaweedFS S3 (`launcher.seaweed`) and a
control plane on them, then N real `engine_agent.agent.Agent`s spread over `--swarm-procs`
worker processes (`bench/swarm.py`), each with a `NullEngine` that only records commits.
Every agent reads the store through a `CappedObjects` (bench/capped_link.py): its own link
capped at `--agent-link-mbps` and the store's egress, shared by every process, capped at
`--store-egress-mbps`, so the figures model a cloud rather than loopback.

The run: one agent alone catches up on v1, then on v2 (the second is the single-engine
catch-up time under the same caps, in a warm process), then the other agents start (at
`--start-per-s`, booted on v0, they catch up on v2),
then `--versions` versions are published one at a time, each once the fleet serves the
previous one. Per version: seconds from publication until 50/90/99/100 % of the engines
serve it, store bytes read while it spread over its size, and every long-poll that woke an
agent for it. Over the whole chain: heartbeat round trips and wake-ups as the agents see
them and as the control plane saw them (its own histograms, `bench/cp_latency.py`), the
swarm's event-loop lag, control-plane and swarm CPU.

With several `--engines`, each scale runs on a fresh stack and models of the time to 99 %
are fitted to the points (linear in N: the store's egress is the bottleneck; logarithmic in
N: a fan-out tree is; the tree anchored at one engine's catch-up), with their error on each
measured point and their prediction for 10,000 engines. Ends with ONE JSON line (the largest
scale's figures and the models). It measures; it never asserts. Heavy scales are a
benchmark, never a test.
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer

from bench import cp_latency
from bench.swarm import SwarmPool, SwarmSpec
from launcher.processes import TETHER, ManagedProcess, ProcessGroup, free_port, parse_cpus, pin

log = logging.getLogger(__name__)

RUN = "fleet"
CONVERGE_DEADLINE_S = 600.0
# ... or this many times one engine's catch-up under the same caps, if longer: on links slow
# enough that one engine takes minutes, a fleet's first catch-up (two versions, every engine
# starting) takes tens of minutes without anything being wrong.
CONVERGE_DEADLINE_SINGLES = 20.0


def converge_deadline(single_s: float) -> float:
    """How long the fleet may take to serve a version before the run counts as failed."""
    return max(CONVERGE_DEADLINE_S, CONVERGE_DEADLINE_SINGLES * single_s)


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
    # Fetch threads of each swarm process (one pool for all its agents).
    threads: int = 256
    # Swarm worker processes, each running its share of the agents on its own event loop.
    procs: int = field(default_factory=lambda: default_procs())
    # Agents started per second over the whole swarm (never in waves waiting on the slowest).
    start_per_s: float = 100.0
    # Peer-assisted fetch (docs/peers.md): agents read version files from each other first,
    # each uploading at most its link's rate.
    peers: bool = False
    # Agents whose kept files are damaged right after each is saved: they serve peers
    # corrupted bytes (every `engines // bad_peers`-th agent, the first one included).
    bad_peers: int = 0
    # Agents pass a file on in pieces of this size while it arrives (cut-through): small
    # next to a version's files, as 64 MiB is next to a real shard.
    peer_chunk_bytes: int = 2048
    # Children per peer in the control plane's fetch tree (`TETHER_PEER_FANOUT`): a peer's
    # upload, capped at its link's rate, is shared by that many children.
    peer_fanout: int = 2
    # Shard files per delta version (a real checkpoint's delta has hundreds): the control
    # plane deals a version's shards out to `peer_fanout` trees, so more than one lets every
    # agent take its files from several parents at once.
    shards: int = 4
    # CPUs of the control plane and its PostgreSQL alone; the bench, its swarm and the S3
    # server run on the others. Empty: everything shares every core.
    controlplane_cpus: frozenset[int] = frozenset()
    # Every link runs this many times its cap until the whole fleet serves its first
    # version (not measured), so that on slow links a cold start of every engine at once
    # does not take most of the run; the measured versions run at the caps.
    first_catchup_speedup: float = 1.0
    # Settle each swarm process's cycle collector once the fleet is up (as a control plane
    # settles its own): freeze what exists, and collect rarely. A real agent runs alone in
    # its process; a thousand in one make every full collection scan all of them.
    settle_gc: bool = True

    @property
    def caps(self) -> dict[str, float]:
        return {
            "agent_link_MBps": self.agent_link_mbps,
            "store_egress_MBps": self.store_egress_mbps,
        }


def default_procs(controlplane_cpus: frozenset[int] = frozenset()) -> int:
    """One swarm process per core the control plane does not have to itself (the servers
    share them)."""
    return max(1, len(os.sched_getaffinity(0) - controlplane_cpus))


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
    # The control plane's and PostgreSQL's own CPUs (none: all share every core), and the
    # CPUs the bench may use as it started (it runs on those left to it meanwhile).
    cores: set[int] = field(default_factory=set)
    everywhere: set[int] = field(default_factory=lambda: os.sched_getaffinity(0))

    @classmethod
    def start(cls, work: Path, config: FleetConfig) -> Stack:
        from launcher.postgres import PostgresServer
        from launcher.seaweed import SeaweedS3

        stack = cls(work, ProcessGroup(work / "logs"), cores=set(config.controlplane_cpus))
        stack.group.__enter__()
        cores = stack.cores
        try:
            if cores:  # the servers started from here inherit the rest
                pin(os.getpid(), stack.everywhere - cores)
            stack.postgres = PostgresServer.create().start()
            if cores:
                pin(stack.postgres.pid, cores)
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
                "TETHER_PEER_FANOUT": str(config.peer_fanout),
                **stack.s3.environment(),
            }
            stack.controlplane = stack.group.start(
                "controlplane",
                [TETHER, "controlplane", "serve", "--db", db_url, "--store", stack.store_url,
                 "--port", str(port), "--log-level", "warning"],
                env=env,
                url=stack.url,
            )  # fmt: skip
            if cores:
                pin(stack.controlplane.process.pid, cores)
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
            if self.cores:
                pin(os.getpid(), self.everywhere)
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
        self.shards = config.shards
        self.store = Store(stack.store_url, storage_options=dict(stack.s3.storage_options))
        # Square BF16 tensors of 256 × 256 (128 KB each) up to the model size asked for.
        count = max(1, round(config.model_kb * 1024 / (256 * 256 * 2)))
        shapes = {f"model.layers.{i}.mlp.up_proj.weight": (256, 256) for i in range(count)}
        self.weights = random_checkpoint(seed=0, shapes=shapes)
        self.sizes: dict[int, int] = {}
        self.shard_sizes: dict[int, int] = {}
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
        from store.codecs import DEFAULT_SHARD_BYTES, encode_version
        from store.types import VersionRef

        def encode(shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, bytes]:
            return encode_version(
                self.weights,
                base,
                version=version,
                base_version=None if base is None else version - 1,
                codec="full" if base is None else "sparse",
                shard_bytes=shard_bytes,
            )

        files = encode()
        if base is not None and self.shards > 1:
            whole = sum(len(data) for name, data in files.items() if name.endswith(".safetensors"))
            files = encode(max(1, -(-whole // self.shards)))
        self.store.publish(VersionRef(RUN, version), files)
        self.sizes[version] = sum(len(data) for data in files.values())
        self.shard_sizes[version] = sum(
            len(data) for name, data in files.items() if name.endswith(".safetensors")
        )
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


def fraction_time(times: list[float], total: int, fraction: float) -> float | None:
    """Seconds until `fraction` of `total` engines got there (None if they never did)."""
    needed = max(1, math.ceil(fraction * total - 1e-9))
    return times[needed - 1] if len(times) >= needed else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _measure(config: FleetConfig, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    began = time.perf_counter()
    stack = Stack.start(work, config)
    say(f"PostgreSQL, S3 and the control plane up in {time.perf_counter() - began:.1f}s")
    trainer: Trainer | None = None
    pools: list[SwarmPool] = []  # the one started, for the cleanup
    try:
        trainer = Trainer(stack, config)
        boot = work / "boot"
        trainer.boot(boot)
        procs = max(1, min(config.procs, config.engines))
        # A fetch holds its thread while its capped link carries the bytes, and a peer
        # fetch while its parent forwards them: with fewer threads than fetches at once, a
        # catch-up waits for the pool (and a parent's own fetch behind its children's),
        # so every process gets at least two per agent it runs.
        threads = max(config.threads, 2 * math.ceil(config.engines / procs) + 32)
        spec = SwarmSpec(
            engines=config.engines, run=RUN, control_plane=stack.url,
            engine_token=stack.tokens["engine"], store_url=stack.store_url,
            storage_options=dict(stack.s3.storage_options), boot=boot, work=work / "agents",
            agent_link_mbps=config.agent_link_mbps, threads=threads,
            start_per_s=config.start_per_s, peers=config.peers, bad_peers=config.bad_peers,
            peer_chunk_bytes=config.peer_chunk_bytes, settle_gc=config.settle_gc,
        )  # fmt: skip
        began = time.perf_counter()
        pool = SwarmPool(spec, procs, config.store_egress_mbps)
        pools.append(pool)
        say(f"{procs} swarm processes ready in {time.perf_counter() - began:.1f}s")
        # The single-engine catch-up under the same caps: one agent alone.
        pool.add([0])
        pool.wait_until(lambda: 0 in pool.registered, 120.0, lambda: "agent-0 not registered")
        # Twice: the first catch-up of a fresh process also loads the compiled kernels and
        # opens its connections (1.6-10 s on this machine); the second is the one timed,
        # as every measured catch-up below runs in warm processes.
        for _ in range(2):
            v1 = trainer.publish_next()
            pool.wait_serving(v1, 1, CONVERGE_DEADLINE_S)
            single_s = pool.reached(v1, trainer.published_at[v1])[0]
            say(f"single engine catches up on v{v1} ({trainer.sizes[v1]} B) in {single_s:.3f}s")
        started = time.perf_counter()
        if config.first_catchup_speedup != 1.0:
            pool.speed_up(config.first_catchup_speedup)
        pool.add(range(1, config.engines))
        # Time to start them at the asked rate, and as long again for a slow machine.
        start_deadline = 120.0 + 2 * config.engines / config.start_per_s
        pool.wait_until(
            lambda: len(pool.registered) >= config.engines,
            start_deadline,
            lambda: f"{len(pool.registered)}/{config.engines} agents registered",
        )
        registered_s = time.perf_counter() - started
        pool.wait_serving(v1, config.engines, converge_deadline(single_s))
        if config.first_catchup_speedup != 1.0:
            pool.speed_up(1.0)
        say(
            f"{config.engines} agents in {procs} processes registered in {registered_s:.1f}s, "
            f"on v{v1} in {time.perf_counter() - started:.1f}s"
        )
        rows = []
        pool.record(True)
        cp_before = cp_latency.scrape(stack.url)
        snapshots0 = _snapshot_counts(stack.url)
        first0 = cp_latency.counter(stack.url, ANSWERED_FIRST)
        cpu0, wall0 = stack.controlplane_cpu_s(), time.perf_counter()
        for _ in range(config.versions):
            egress0, kinds0 = pool.egress.bytes, pool.egress.by_kind()
            cp_read0 = cp_latency.counter(stack.url, STORE_READS)
            version = trainer.publish_next()
            published = trainer.published_at[version]
            pool.wait_serving(version, config.engines, converge_deadline(single_s))
            times = pool.reached(version, published)
            seen = trainer.convergence(version)
            woken = [t - published for t in pool.woken.get(version, [])]
            # The control plane reads the store too (each version's claim and index, once,
            # to hand out with fetch plans): its bytes count in the store's egress.
            cp_read = cp_latency.counter(stack.url, STORE_READS) - cp_read0
            row: dict[str, Any] = {
                "version": version,
                "version_bytes": trainer.sizes[version],
                **{f"t{int(f * 100)}_s": fraction_time(times, config.engines, f)
                   for f in (0.5, 0.9, 0.99, 1.0)},
                "store_egress_bytes": pool.egress.bytes - egress0 + cp_read,
                "store_controlplane_bytes": cp_read,
                "shard_bytes": trainer.shard_sizes[version],
                **{f"store_{kind}_bytes": n - kinds0[kind]
                   for kind, n in pool.egress.by_kind().items()},
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
        pool.record(False)
        cp_seen = cp_latency.window(cp_before, cp_latency.scrape(stack.url))
        snapshots = {how: n - snapshots0[how] for how, n in _snapshot_counts(stack.url).items()}
        answered_first = cp_latency.counter(stack.url, ANSWERED_FIRST) - first0
        began = time.perf_counter()
        summaries = pool.stop()
        say(f"{config.engines} agents stopped in {time.perf_counter() - began:.1f}s")
        wakes = [t - trainer.published_at[r["version"]] for r in rows
                 for t in pool.woken.get(r["version"], [])]  # fmt: skip
        beats = [b for s in summaries for b in s["heartbeat_s"]]
        lag = [x for s in summaries for x in s["loop_lag_s"]]
        gc_pauses = [x for s in summaries for x in s["gc_pause_s"]]
        cp_beats = cp_seen["tether_heartbeat_seconds"]
        cp_commits = cp_seen["tether_heartbeat_commit_seconds"]
        cp_wakes = cp_seen["tether_target_wake_seconds"]
        cp_gc = cp_seen["tether_gc_pause_seconds"]

        def mean(key: str) -> float:
            return sum(r[key] for r in rows) / len(rows)

        def total(key: str) -> Any:
            return sum((Tally(s[key]) for s in summaries), Tally())

        p99 = mean("t99_s")
        differing = pool.differing()
        return {
            "engines": config.engines,
            "versions": config.versions,
            "version_bytes": round(mean("version_bytes")),
            "shards": config.shards,
            "caps": config.caps,
            "controlplane_cpus": sorted(config.controlplane_cpus),
            "heartbeat_interval_s": config.heartbeat_s,
            "first_catchup_speedup": config.first_catchup_speedup,
            "swarm_procs": procs,
            "agents_registered_s": round(registered_s, 2),
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
            # The same split by what was read: the version's shards (what grows with the
            # model) and the index, claim and pointer reads made to plan and verify (a few
            # hundred bytes each, whatever the model's size), the engines' and the control
            # plane's (which reads each version's claim and index once for the engines).
            "store_shard_egress_over_shard_bytes": round(
                sum(r["store_shards_bytes"] for r in rows) / sum(r["shard_bytes"] for r in rows),
                3,
            ),
            "store_planning_bytes_per_engine": round(
                sum(
                    r["store_index_bytes"] + r["store_other_bytes"] + r["store_controlplane_bytes"]
                    for r in rows
                )
                / (len(rows) * config.engines)
            ),
            "store_controlplane_bytes_per_version": round(
                sum(r["store_controlplane_bytes"] for r in rows) / len(rows)
            ),
            "peer_bytes": sum(s["peer_bytes"] for s in summaries),
            "store_bytes": sum(s["store_bytes"] for s in summaries),
            # Bytes a source served that failed verification (thrown away), and the sources
            # dropped by reason (digest, size, stall, error, unavailable).
            "rejected_bytes": sum(s["rejected_bytes"] for s in summaries),
            "source_faults": dict(total("source_faults")),
            # Engines whose staged weights for a version differ from the others' (the
            # store's bytes, verified): any byte of a bad peer that got through shows here.
            "commits_differing": differing,
            "bad_peer_bytes_used": 0 if differing == 0 else None,
            # Client side (the agents' HTTP clients, so the swarm's own lateness included)...
            "heartbeats": len(beats),
            "heartbeat_p50_ms": _ms(percentile(beats, 0.5)),
            "heartbeat_p99_ms": _ms(percentile(beats, 0.99)),
            "wake_p50_ms": _ms(percentile(wakes, 0.5)),
            "wake_p99_ms": _ms(percentile(wakes, 0.99)),
            # ...and the control plane's side (its histograms, linear within a bucket).
            "cp_heartbeats": cp_latency.count(cp_beats),
            "cp_heartbeat_p50_ms": _ms(cp_latency.quantile(cp_beats, 0.5)),
            "cp_heartbeat_p99_ms": _ms(cp_latency.quantile(cp_beats, 0.99)),
            # Beats answered before their commit (the snapshot showed the lease), and how
            # long after its arrival each beat's lease renewal was committed.
            "cp_heartbeats_answered_first": int(answered_first),
            "cp_heartbeat_commit_p50_ms": _ms(cp_latency.quantile(cp_commits, 0.5)),
            "cp_heartbeat_commit_p99_ms": _ms(cp_latency.quantile(cp_commits, 0.99)),
            "cp_wakes": cp_latency.count(cp_wakes),
            "cp_wake_p50_ms": _ms(cp_latency.quantile(cp_wakes, 0.5)),
            "cp_wake_p99_ms": _ms(cp_latency.quantile(cp_wakes, 0.99)),
            # Its cycle collections (each holds every request): how many, how many held
            # it over 50 ms, and the p99 pause.
            "cp_gc_pauses": cp_latency.count(cp_gc),
            "cp_gc_pauses_over_50ms": cp_latency.above(cp_gc, 0.05) if cp_gc else None,
            "cp_gc_pause_p99_ms": _ms(cp_latency.quantile(cp_gc, 0.99)),
            # How the control plane kept its fleet snapshot current over the window: full
            # reads of every engine's row, and heartbeats patched in without one.
            "cp_snapshot_reads": snapshots["read"],
            "cp_snapshot_changed_reads": snapshots["changed"],
            "cp_snapshot_patches": snapshots["patch"],
            "controlplane_cpu_cores": round(cp_cpu / wall, 3),
            "swarm_cpu_cores": round(sum(s["cpu_s"] for s in summaries) / wall, 3),
            # The swarm's CPU over the window (catch-ups, and every heartbeat, long-poll and
            # peer upload meanwhile) per catch-up: what one more engine costs the machine.
            "swarm_cpu_ms_per_catchup": round(
                1000 * sum(s["cpu_s"] for s in summaries) / (config.engines * config.versions), 2
            ),
            "swarm_rss_mb_per_agent": round(
                sum(s["max_rss_kb"] for s in summaries) / 1024 / config.engines, 2
            ),
            "swarm_threads": sum(s["threads"] for s in summaries),
            # How late the swarm's event loops wake (a 100 ms sleep's overshoot, all
            # processes): the part of the client-side latencies that is the swarm's own.
            "swarm_loop_lag_p50_ms": _ms(percentile(lag, 0.5)),
            "swarm_loop_lag_p99_ms": _ms(percentile(lag, 0.99)),
            # The swarm processes' cycle collections over the window (each holds the GIL).
            "swarm_gc_settled": config.settle_gc,
            "swarm_gc_pauses": len(gc_pauses),
            "swarm_gc_pause_max_ms": _ms(max(gc_pauses, default=None)),
            "swarm_gc_s": round(sum(gc_pauses), 3),
            # Reconcile passes that failed and were retried (timeouts on a starved machine),
            # by error type: each re-reads its versions from the store.
            "failed_passes": dict(total("failures")),
            "load_1m": round(os.getloadavg()[0], 2),
            "per_version": rows,
        }
    finally:
        for each in pools:
            each.close()
        if trainer is not None:
            trainer.close()
        stack.close()


# The control plane's own reads of the store (its copy of each version's claim and index).
STORE_READS = "tether_store_read_bytes_total"
SNAPSHOTS = "tether_fleet_snapshots_total"
ANSWERED_FIRST = "tether_heartbeats_answered_first_total"


def _snapshot_counts(url: str) -> dict[str, int]:
    """How often the control plane at `url` has read its fleet snapshot from the database
    (every row, or the rows written since its last read), and patched heartbeats into it,
    so far."""
    counted = cp_latency.counter_by(url, SNAPSHOTS, "how")
    return {how: int(counted.get(how, 0)) for how in ("read", "changed", "patch")}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def measure(config: FleetConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """One scale on a fresh stack in a temporary folder (removed afterwards)."""
    work = Path(tempfile.mkdtemp(prefix="tether-bench-fleet-"))
    # SIGTERM ends the measurement as Ctrl-C does: through the cleanup (every server and
    # swarm process stopped).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _measure(config, work, say)
    except Exception:
        # Keep the servers' logs of a failed scale: they say what gave way.
        kept = Path(tempfile.mkdtemp(prefix="tether-bench-fleet-logs-"))
        shutil.copytree(work / "logs", kept / "logs", dirs_exist_ok=True)
        say(f"the servers' logs are kept in {kept}")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


FORMS = {"linear": "N", "log": "log2(N)", "tree": "log2(N)"}


@dataclass(frozen=True)
class Fit:
    """t(N) = a + b·g(N) by least squares: g = N (`linear`: the store's egress is the
    bottleneck) or log2 N (`log`: a fan-out tree; `tree`: the same with a fixed at one
    engine's measured catch-up, so only the cost per tree level is fitted)."""

    form: str
    a: float
    b: float
    # (engines, measured seconds, predicted seconds) for each point it was fitted to.
    points: tuple[tuple[int, float, float], ...] = ()

    @property
    def max_rel_error(self) -> float:
        return max((abs(p - t) / t for _, t, p in self.points if t > 0), default=0.0)

    def predict(self, n: float) -> float:
        return self.a + self.b * _basis(self.form, n)

    def as_dict(self) -> dict[str, Any]:
        return {
            "form": f"t = {self.a:.4g} + {self.b:.4g}·{FORMS[self.form]}",
            "max_rel_error_on_measured": round(self.max_rel_error, 4),
            "on_measured": [
                {
                    "engines": n,
                    "measured_s": round(t, 3),
                    "predicted_s": round(p, 3),
                    "error": round((p - t) / t, 4) if t > 0 else None,
                }
                for n, t, p in self.points
            ],
            f"predicted_{TARGET_N}_s": round(self.predict(TARGET_N), 3),
        }


def _basis(form: str, n: float) -> float:
    return n if form == "linear" else math.log2(n)


def fit(points: list[tuple[int, float]], form: str, anchor: float | None = None) -> Fit:
    """Least-squares fit of `form` to (engines, seconds) points (one point: b = 0);
    with `anchor`, a is fixed at it and only b is fitted."""
    xs = [_basis(form, n) for n, _ in points]
    ys = [t for _, t in points]
    if anchor is not None:
        a = anchor
        square = sum(x * x for x in xs)
        b = sum(x * (y - a) for x, y in zip(xs, ys, strict=True)) / square if square else 0.0
    else:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        a = my - b * mx
    fitted = tuple((n, t, a + b * x) for (n, t), x in zip(points, xs, strict=True))
    return Fit(form, a, b, fitted)


def models(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The fits of the time to 99 % over the measured scales, and the best one's
    prediction for `TARGET_N` engines."""
    points = [(r["engines"], r["converged_p99_s"]) for r in results]
    single = sum(r["single_catchup_s"] for r in results) / len(results)
    fits = [fit(points, "linear"), fit(points, "log"), fit(points, "tree", anchor=single)]
    best = min(fits, key=lambda f: f.max_rel_error)
    return {
        "converged_p99": {f.form: f.as_dict() for f in fits},
        "converged_p99_best": best.form,
        f"converged_p99_predicted_{TARGET_N}_s": round(best.predict(TARGET_N), 3),
    }


def earlier_scales(path: Path) -> list[dict[str, Any]]:
    """The scales in the last JSON line of an earlier run's output saved in `path`."""
    last = [line for line in path.read_text().splitlines() if line.startswith("{")][-1]
    summary = json.loads(last)
    scales: list[dict[str, Any]] = summary.get("scales") or [summary]
    return scales


def _positive(value: float) -> float:
    """A rate or interval option: refused (exit 2, naming the option) unless above 0."""
    if value <= 0:
        raise typer.BadParameter(f"{value} is not above 0; give a positive number")
    return value


def run(
    engines: list[int] = typer.Option(
        [100], min=1, help="fleet sizes to run, each on a fresh stack"
    ),
    versions: int = typer.Option(3, min=1, help="versions published (one at a time) per scale"),
    model_kb: int = typer.Option(512, min=1, help="size of the synthetic BF16 model in KiB"),
    agent_link_mbps: float = typer.Option(
        0.03, callback=_positive, help="each agent's link in MB/s"
    ),
    store_egress_mbps: float = typer.Option(
        0.3, callback=_positive, help="the store's egress in MB/s"
    ),
    heartbeat_s: float = typer.Option(
        5.0, callback=_positive, help="heartbeat interval the control plane asks"
    ),
    threads: int = typer.Option(
        256, help="fetch worker threads in each swarm process (at least 2 per agent it runs)"
    ),
    swarm_procs: int = typer.Option(
        0, help="swarm worker processes (0: one per core)", show_default=False
    ),
    start_per_s: float = typer.Option(
        100.0, callback=_positive, help="agents started per second (whole swarm)"
    ),
    peers: bool = typer.Option(False, help="peer-assisted fetch between the agents"),
    bad_peers: int = typer.Option(0, min=0, help="agents that serve their peers damaged files"),
    peer_fanout: int = typer.Option(2, min=1, help="children per peer in the fetch tree"),
    shards: int = typer.Option(4, min=1, help="shard files per delta version"),
    peer_chunk_bytes: int = typer.Option(
        2048,
        min=1024,  # the agent's own floor (AgentSettings.peer_chunk_bytes)
        help="piece a file is forwarded in while it arrives (cut-through)",
    ),
    earlier: list[Path] = typer.Option(
        [], help="saved output of an earlier run: its scales join this run's for the models"
    ),
    first_catchup_speedup: float = typer.Option(
        1.0,
        callback=_positive,
        help="run every link this many times its cap until the fleet serves its first "
        "version (not measured); the measured versions run at the caps",
    ),
    settle_swarm_gc: bool = typer.Option(
        True,
        help="freeze and space out each swarm process's cycle collections once the fleet "
        "is up (a real agent runs alone in its process; a thousand in one make every full "
        "collection scan them all)",
    ),
    controlplane_cpus: str = typer.Option(
        "",
        help="CPUs (e.g. 0 or 0-1) for the control plane and its PostgreSQL alone; the swarm "
        "and the S3 server get the others (default: all share every core)",
    ),
) -> None:
    """A swarm of real agents with null engines: convergence, store egress, heartbeats."""
    logging.basicConfig(level=logging.WARNING)
    # A full boto3 pool is expected with hundreds of fetch threads; it is not news.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    try:
        cores = frozenset(parse_cpus(controlplane_cpus)) if controlplane_cpus else frozenset()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--controlplane-cpus") from None
    if cores and not os.sched_getaffinity(0) - cores:
        raise typer.BadParameter(
            "leaves no CPU for the swarm; name fewer CPUs", param_hint="--controlplane-cpus"
        )
    results: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for n in engines:
        config = FleetConfig(
            engines=n, versions=versions, model_kb=model_kb, agent_link_mbps=agent_link_mbps,
            store_egress_mbps=store_egress_mbps, heartbeat_s=heartbeat_s,
            lease_s=max(10.0, heartbeat_s * 5), threads=threads,
            procs=swarm_procs or default_procs(cores), start_per_s=start_per_s, peers=peers,
            bad_peers=bad_peers, peer_fanout=peer_fanout, shards=shards,
            peer_chunk_bytes=peer_chunk_bytes, controlplane_cpus=cores,
            first_catchup_speedup=first_catchup_speedup, settle_gc=settle_swarm_gc,
        )  # fmt: skip
        print(
            f"--- {n} engines in {min(n, config.procs)} swarm processes, caps {config.caps}, "
            f"load {os.getloadavg()[0]:.2f}"
        )
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
            f"heartbeat p99 {result['heartbeat_p99_ms']} ms (control plane's side "
            f"{result['cp_heartbeat_p99_ms']} ms, {result['cp_heartbeats_answered_first']} "
            f"answered before their commit, commit p99 {result['cp_heartbeat_commit_p99_ms']} "
            f"ms); wake p99 {result['wake_p99_ms']} ms "
            f"(control plane's side {result['cp_wake_p99_ms']} ms); swarm loop lag p99 "
            f"{result['swarm_loop_lag_p99_ms']} ms, its collections {result['swarm_gc_s']} s "
            f"in {result['swarm_gc_pauses']} pauses; control plane "
            f"{result['controlplane_cpu_cores']} cores, swarm {result['swarm_cpu_cores']} cores "
            f"({result['swarm_cpu_ms_per_catchup']} ms per catch-up)"
        )
    if not results:
        print(json.dumps({"engines": 0, "failed": failures}))
        raise typer.Exit(1)
    summary = {k: v for k, v in results[-1].items() if k != "per_version"}
    summary["failed"] = failures
    summary["scales"] = [{k: v for k, v in r.items() if k != "per_version"} for r in results]
    scales = [s for path in earlier for s in earlier_scales(path)] + summary["scales"]
    if len({s["engines"] for s in scales}) > 1:
        summary["model"] = models(sorted(scales, key=lambda s: s["engines"]))
        for form, described in summary["model"]["converged_p99"].items():
            print(f"model ({form}): {described}")
    print(json.dumps(summary))


if __name__ == "__main__":
    typer.run(run)
