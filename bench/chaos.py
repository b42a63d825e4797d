"""`tether bench chaos`: fault scenarios against real processes, under a pinned client load.

Each scenario starts its own fleet (a control plane on SQLite or PostgreSQL, one or two
replicas, CPU reference engines with their agents, a folder store or SeaweedFS S3), runs a
client load of version-pinned requests (`exact_version` and `min_version` of the latest
published version, alternately) for its whole length, injects one fault, lifts it, and
reports:

- `requests_lost`: requests that failed non-retryably (a status other than 200/409/503, a
  malformed answer) — a request that kept getting 409/503 until its deadline failed
  retryably and is counted apart (`retryable_failures`), never silently;
- `constraint_violations`: answers whose `weight_version_start`/`_end` break the request's
  constraint;
- `recovery_s`: from the moment the fault is lifted until a request sent after it succeeds
  (None: never within the scenario's deadline);
- `data_lost`: published versions that no longer verify in the store.

A scenario passes when nothing is lost or violated, the fleet recovers, and the fleet ends
on the last published version. `SCENARIOS` is the list the tests parametrize over; `scale`
shrinks every fault's duration for them. It never mocks a component: every fault is a real
signal, a stopped server or a cut TCP link.

Why over 500 lines: the scenarios are one catalogue, each a short function over the same
fleet harness; splitting them would scatter the list the tests parametrize over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer

from launcher.fault_proxy import ResettingProxy
from launcher.processes import (
    TETHER,
    DeadlineExceeded,
    ManagedProcess,
    ProcessGroup,
    free_port,
    wait_until,
)

log = logging.getLogger(__name__)

RUN = "chaos"
ROLES = ("trainer", "engine", "client")
LEASE_S = 5.0
CONVERGE_DEADLINE_S = 90.0
# Bounds on a process's start (each wait ends when it answers): an engine has taken a
# minute to boot on two loaded cores.
ENGINE_START_S = 180.0
AGENT_START_S = 180.0
PROMPT = {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
RETRYABLE = frozenset({409, 503})
# One engine kept on each version a client pinned, within 8 versions of latest.
KEEP_PINNED = {"kind": "keep_pinned", "engines": 1, "max_lag": 8, "window_s": 600}


# ---------------------------------------------------------------------------- the load


@dataclass
class RequestRecord:
    """One client request of the load: when, what it asked, how it ended."""

    started: float
    ended: float
    constraint: dict[str, int]
    outcome: str  # ok | violation | lost | retryable_failure
    detail: str = ""
    # Attempts that met a refused or reset connection on the way (timeouts are not counted:
    # a busy machine explains them).
    transport_errors: int = 0


class PinnedLoad:
    """Workers that send version-pinned `/v1/generate` requests until stopped.

    Like a load balancer in front of the replicas, a request that meets a transport error,
    a 503 or a 409 is retried (on the next control-plane URL) until its deadline.
    """

    def __init__(
        self,
        urls: Callable[[], list[str]],
        token: str,
        latest: Callable[[], int],
        *,
        workers: int = 2,
        deadline_s: float = 30.0,
    ) -> None:
        self.urls = urls
        self.token = token
        self.latest = latest
        self.workers = workers
        self.deadline_s = deadline_s
        self.records: list[RequestRecord] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="chaos-load", daemon=True)

    def __enter__(self) -> PinnedLoad:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(self.deadline_s + 30)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(headers=headers, timeout=20.0) as client:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.workers)))

    async def _worker(self, client: httpx.AsyncClient, index: int) -> None:
        turn = index
        while not self._stop.is_set():
            turn += 1
            version = self.latest()
            key = "exact_version" if turn % 2 else "min_version"
            self.records.append(await self._one(client, {key: version}, turn))

    async def _one(
        self, client: httpx.AsyncClient, constraint: dict[str, int], turn: int
    ) -> RequestRecord:
        from store.types import VersionConstraint

        body = {**PROMPT, "run_id": RUN, "weight_version": constraint}
        wanted = VersionConstraint(constraint.get("min_version"), constraint.get("exact_version"))
        started = time.monotonic()
        deadline = started + self.deadline_s
        last = ""
        attempt = 0
        transport_errors = 0
        while time.monotonic() < deadline:
            urls = self.urls()
            url = urls[(turn + attempt) % len(urls)]
            attempt += 1
            try:
                reply = await client.post(f"{url}/v1/generate", json=body)
            except httpx.TimeoutException as exc:
                last = f"transport: {type(exc).__name__}"
            except httpx.TransportError as exc:
                last = f"transport: {type(exc).__name__}"
                transport_errors += 1
            else:
                if reply.status_code == 200:
                    try:
                        answer = reply.json()
                        answer = answer[0] if isinstance(answer, list) else answer
                        span = (answer["weight_version_start"], answer["weight_version_end"])
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        return self._done(
                            started, constraint, "lost", f"malformed: {exc}", transport_errors
                        )
                    ok = all(wanted.satisfied_by(int(v)) for v in span)
                    outcome = "ok" if ok else "violation"
                    return self._done(
                        started, constraint, outcome, f"served {span}", transport_errors
                    )
                if reply.status_code not in RETRYABLE:
                    return self._done(
                        started, constraint, "lost", f"{reply.status_code} {reply.text[:200]}",
                        transport_errors,
                    )  # fmt: skip
                last = f"{reply.status_code} {reply.text[:120]}"
            # A short pause between attempts, bounded by the request's deadline.
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self._done(started, constraint, "retryable_failure", last, transport_errors)

    @staticmethod
    def _done(
        started: float, constraint: dict[str, int], outcome: str, detail: str, transport: int
    ) -> RequestRecord:
        return RequestRecord(started, time.monotonic(), constraint, outcome, detail, transport)


# ---------------------------------------------------------------------------- the fleet


@dataclass
class Replica:
    """One control-plane process on a fixed port (a restart keeps the address)."""

    port: int
    process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Member:
    """One reference engine (fixed port) and its agent."""

    name: str
    engine_port: int
    engine: ManagedProcess | None = None
    agent: ManagedProcess | None = None
    agent_port: int = 0


@dataclass
class FleetSpec:
    db: str = "sqlite"  # sqlite | postgres
    store: str = "folder"  # folder | s3
    replicas: int = 1
    engines: int = 1
    partitionable: bool = False  # agents reach the control plane through a fault proxy


class ChaosFleet:
    """The processes of one scenario, all stopped when the `with` block ends."""

    def __init__(self, work: Path, spec: FleetSpec) -> None:
        self.work = work
        self.spec = spec
        self.group = ProcessGroup(work / "logs")
        self.admin = "tth_chaos-" + secrets.token_hex(16)
        self.tokens: dict[str, str] = {}
        self.replicas = [Replica(free_port()) for _ in range(spec.replicas)]
        self.members: list[Member] = []
        self.published: list[int] = []
        self.child_env: dict[str, str] = {}
        self.postgres: Any = None
        self.seaweed: Any = None
        self.proxy: ResettingProxy | None = None
        self._weights: dict[str, Any] = {}
        self._publisher: Any = None

    # --------------------------------------------------------------- lifecycle

    def __enter__(self) -> ChaosFleet:
        self.group.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        try:
            self.close_publisher()
            self.group.__exit__()
        finally:
            if self.proxy is not None:
                self.proxy.__exit__()
            if self.seaweed is not None:
                self.seaweed.stop()
            if self.postgres is not None:
                self.postgres.remove()

    def _start(self) -> None:
        from reference_engine.tiny_model import TinyModelSpec, init_tiny_model
        from trainer_client.publisher import Publisher, load_hf_folder

        self.model = init_tiny_model(self.work / "model", TinyModelSpec(seed=0))
        if self.spec.db == "postgres":
            from launcher.postgres import PostgresServer

            self.postgres = PostgresServer.create().start()
            self.db_url = self.postgres.create_database("chaos")
        else:
            self.db_url = f"sqlite:///{self.work / 'cp.db'}"
        # Engines need nothing of the rest: they boot while the control plane starts.
        for index in range(self.spec.engines):
            member = Member(f"engine-{index}", free_port())
            self.members.append(member)
            self.launch_engine(member)
        storage_options: dict[str, Any] | None = None
        if self.spec.store == "s3":
            from launcher.seaweed import SeaweedS3

            self.seaweed = SeaweedS3.create(self.work / "seaweed")
            server = self.seaweed.start()
            self.store_url = server.url("chaos")
            self.child_env = server.environment()
            storage_options = server.storage_options
        else:
            self.store_url = str(self.work / "store")
        for replica in self.replicas:
            self.start_replica(replica)  # one at a time: the first one migrates
        for role in ROLES:
            reply = httpx.post(
                self.replicas[0].url + "/v1/tokens",
                json={"role": role, "name": f"chaos-{role}"},
                headers={"Authorization": f"Bearer {self.admin}"},
                timeout=30.0,
            )
            reply.raise_for_status()
            self.tokens[role] = reply.json()["token"]
        if self.spec.partitionable:
            self.proxy = ResettingProxy(self.replicas[0].url).__enter__()
        self._publisher = Publisher(
            self.store_url, RUN, self.replicas[0].url, self.tokens["trainer"],
            storage_options=storage_options, progress=False, upload_attempts=2,
        )  # fmt: skip
        self._publisher.claim(0, self.model)
        self.published.append(0)
        self._weights = load_hf_folder(self.model)
        # Every agent starts at once (an agent waits for its engine to answer by itself).
        for member in self.members:
            self.launch_agent(member)
        for member in self.members:
            self.wait_engine(member)
            self.wait_agent(member)
        self.wait_converged(0)

    # --------------------------------------------------------------- processes

    @property
    def urls(self) -> list[str]:
        """The control-plane URLs a client may use (every replica, alive or not)."""
        return [r.url for r in self.replicas]

    def start_replica(self, replica: Replica) -> None:
        env = {
            "TETHER_ADMIN_TOKEN": self.admin,
            "TETHER_LEASE_SECONDS": str(LEASE_S),
            "TETHER_HEARTBEAT_INTERVAL_S": "0.5",
            "TETHER_SNAPSHOT_REFRESH_S": "0.1",
            "TETHER_POLL_INTERVAL_S": "0.05",
            "TETHER_DEFAULT_RETRY_AFTER_S": "0.2",
            **self.child_env,
        }
        index = self.replicas.index(replica)
        replica.process = self.group.start(
            f"controlplane-{index}",
            [TETHER, "controlplane", "serve", "--db", self.db_url, "--store", self.store_url,
             "--port", str(replica.port), "--log-level", "warning"],
            env=env,
            url=replica.url,
        )  # fmt: skip
        replica.process.wait_http("/readyz", deadline_s=60.0)

    def kill_replica(self, replica: Replica) -> None:
        assert replica.process is not None
        replica.process.kill()
        replica.process = None

    def start_engine(self, member: Member) -> None:
        self.launch_engine(member)
        self.wait_engine(member)

    def start_agent(self, member: Member) -> None:
        self.launch_agent(member)
        self.wait_agent(member)

    def start_member(self, member: Member) -> None:
        """A fresh replica: its engine and agent started together."""
        self.launch_engine(member)
        self.launch_agent(member)
        self.wait_engine(member)
        self.wait_agent(member)

    def wait_engine(self, member: Member) -> None:
        assert member.engine is not None
        member.engine.wait_http("/ready", deadline_s=ENGINE_START_S)

    def wait_agent(self, member: Member) -> None:
        assert member.agent is not None
        member.agent.wait_http("/server_info", deadline_s=AGENT_START_S)

    def launch_engine(self, member: Member) -> None:
        member.engine = self.group.start(
            member.name,
            [TETHER, "engine", "reference", "--model", str(self.model),
             "--port", str(member.engine_port), "--weight-version", "0", "--threads", "1",
             "--log-level", "warning"],
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
            url=f"http://127.0.0.1:{member.engine_port}",
        )  # fmt: skip

    def launch_agent(self, member: Member) -> None:
        assert member.engine is not None
        member.agent_port = member.agent_port or free_port()
        # Every replica, for an agent that fails over between them (without a load balancer
        # in front, that is how it finds the survivor when one is killed).
        urls = [self.proxy.url] if self.proxy is not None else [r.url for r in self.replicas]
        control_planes = [flag for url in urls for flag in ("--control-plane", url)]
        member.agent = self.group.start(
            f"agent-{member.name}",
            [TETHER, "agent", "run", "--engine-url", member.engine.url or "",
             "--precision", "bf16", *control_planes, "--store", self.store_url,
             "--run", RUN, "--port", str(member.agent_port), "--boot-model", str(self.model),
             "--boot-version", "0", "--work-dir", str(self.work / f"agent-{member.name}"),
             "--capacity", "8", "--log-level", "warning"],
            env={
                "TETHER_TOKEN": self.tokens["engine"],
                "TETHER_AGENT_POINTER_POLL_S": "0.2",
                "TETHER_AGENT_RETRY_INITIAL_S": "0.2",
                "TETHER_AGENT_RETRY_MAX_S": "1",
                "TETHER_AGENT_ENGINE_PROBE_S": "0.3",
                "OMP_NUM_THREADS": "1",
                **self.child_env,
            },
            url=f"http://127.0.0.1:{member.agent_port}",
        )  # fmt: skip

    def server_info(self, member: Member) -> dict[str, Any] | None:
        assert member.agent is not None
        try:
            reply = httpx.get(f"{member.agent.url}/server_info", timeout=5.0)
        except httpx.TransportError:
            return None
        return reply.json() if reply.status_code == 200 else None

    # --------------------------------------------------------------- versions

    def close_publisher(self) -> None:
        """Close the trainer's Publisher (as a trainer that exits does); once only."""
        if self._publisher is not None:
            publisher, self._publisher = self._publisher, None
            publisher.close()

    @property
    def latest(self) -> int:
        return self.published[-1]

    def publish(self) -> int:
        """Publish the next version (a small update of the last); return its number."""
        version = self.latest + 1
        self._weights = self._stepped(version)
        self._publisher.publish(dict(self._weights), version)
        self.published.append(version)
        return version

    def _stepped(self, seed: int) -> dict[str, Any]:
        """The current weights after a small training-like step on two tensors."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        stepped = dict(self._weights)
        for name in sorted(stepped)[:2]:
            tensor = stepped[name]
            step = torch.randn(tensor.shape, generator=generator) * 1e-2
            stepped[name] = (tensor.float() + step).to(tensor.dtype)
        return stepped

    def publish_damaged(self) -> int:
        """Publish a version whose shard payloads are damaged (its manifest matches the
        damaged bytes, as when wrong data was stored as such); return its number. The
        Publisher would never write damaged bytes, so this writes through `Store`."""
        from store.codecs import encode_version
        from store.torch_bridge import state_dict_to_raw
        from store.types import VersionRef

        bad = self.latest + 1
        target, base = state_dict_to_raw(self._stepped(bad)), state_dict_to_raw(self._weights)
        files = encode_version(target, base, version=bad, base_version=self.latest, codec="sparse")
        files = {name: _damaged(data) if name.endswith(".safetensors") else data
                 for name, data in files.items()}  # fmt: skip
        self._store().publish(VersionRef(RUN, bad), files)
        self._notify(bad)
        return bad

    def publish_full_after(self, version: int) -> int:
        """Publish `version` + 1 as a FULL version of the current weights, through `Store`."""
        from store.codecs import encode_version
        from store.torch_bridge import state_dict_to_raw
        from store.types import VersionRef

        good = version + 1
        files = encode_version(
            state_dict_to_raw(self._weights), None, version=good, base_version=None, codec="full"
        )
        self._store().publish(VersionRef(RUN, good), files)
        self._notify(good)
        self.published.append(good)
        return good

    def _store(self) -> Any:
        from store.store import Store

        options = self.seaweed.server.storage_options if self.seaweed is not None else None
        return Store(self.store_url, storage_options=options)

    def _notify(self, version: int) -> None:
        reply = httpx.post(
            f"{self.urls[0]}/v1/runs/{RUN}/versions", json={"version": version}, timeout=30.0,
            headers={"Authorization": f"Bearer {self.tokens['trainer']}"},
        )  # fmt: skip
        reply.raise_for_status()

    def set_policy(self, policy: dict[str, Any]) -> None:
        """Set the run's version policy, as the trainer would."""
        reply = httpx.put(
            f"{self.urls[0]}/v1/runs/{RUN}/policy", json=policy, timeout=30.0,
            headers={"Authorization": f"Bearer {self.tokens['trainer']}"},
        )  # fmt: skip
        reply.raise_for_status()

    def gc(self, keep: int) -> Any:
        """`store gc` of the run; the versions it deleted are no longer owed to anyone."""
        report = self._store().gc(RUN, keep=keep)
        self.published = [v for v in self.published if v not in set(report.deleted)]
        return report

    def pinned_request(self, version: int) -> httpx.Response | None:
        """One request pinned to `version`, through the first replica that answers (None
        when none does)."""
        body = {**PROMPT, "run_id": RUN, "weight_version": {"exact_version": version}}
        for url in self.urls:
            try:
                return httpx.post(
                    f"{url}/v1/generate", json=body, timeout=10.0,
                    headers={"Authorization": f"Bearer {self.tokens['client']}"},
                )  # fmt: skip
            except httpx.TransportError:
                continue
        return None

    def routable(self, version: int) -> bool:
        """A pinned request for `version` succeeds through some replica right now."""
        reply = self.pinned_request(version)
        return reply is not None and reply.status_code == 200

    def refused_for_good(self, version: int) -> dict[str, Any] | None:
        """The error of a request pinned to `version` when it is not retryable, else None."""
        reply = self.pinned_request(version)
        if reply is None or reply.status_code == 200:
            return None
        error = dict(reply.json()["error"])
        return None if error.get("retryable", True) else error

    def wait_converged(self, version: int, deadline_s: float = CONVERGE_DEADLINE_S) -> None:
        """Until every agent serves `version` with nothing staged and a request pinned to
        it is routed."""

        def converged() -> bool:
            for member in self.members:
                info = self.server_info(member)
                if info is None or info["applied_version"] != version:
                    return False
            return self.routable(version)

        wait_until(converged, deadline_s, f"the fleet to serve v{version}", 0.2)

    def data_lost(self) -> list[int]:
        """Published versions that no longer verify in the store."""
        from store.errors import StorageUnavailable
        from store.types import VersionRef

        store = self._store()
        lost = []
        for version in self.published:

            def verified(version: int = version) -> tuple[bool] | None:
                try:
                    return (store.verify(VersionRef(RUN, version)).ok,)
                except StorageUnavailable as exc:  # the store is still coming back: ask again
                    log.info("v%d cannot be read yet: %s", version, exc)
                    return None

            try:
                (ok,) = wait_until(verified, 60, f"v{version} to be readable", 0.5)
            except Exception as exc:  # unreadable for good counts as lost; say why
                log.warning("v%d does not verify: %s", version, exc)
                ok = False
            if not ok:
                lost.append(version)
        return lost


# ---------------------------------------------------------------------------- scenarios


@dataclass
class Chaos:
    """What a scenario function gets: its fleet, its load, the scale of its faults."""

    fleet: ChaosFleet
    scale: float
    fault_lifted: float | None = None

    def hold(self, seconds: float) -> None:
        """Keep a fault in place for `seconds` x scale (the fault's length, not a sync)."""
        time.sleep(seconds * self.scale)

    def lifted(self) -> None:
        self.fault_lifted = time.monotonic()


def controlplane_kill9(chaos: Chaos) -> None:
    """The control plane is killed with SIGKILL under load, a version is published while it
    is down, and it restarts on the same database."""
    fleet = chaos.fleet
    replica = fleet.replicas[0]
    fleet.kill_replica(replica)
    chaos.hold(5)
    fleet.start_replica(replica)
    chaos.lifted()
    fleet.publish()


def replica_killed(chaos: Chaos) -> None:
    """One of two replicas is killed for good; clients and agents carry on with the other."""
    fleet = chaos.fleet
    fleet.kill_replica(fleet.replicas[0])
    fleet.replicas = fleet.replicas[1:]
    chaos.lifted()
    fleet.publish()


def postgres_stopped(chaos: Chaos) -> None:
    """PostgreSQL is stopped (as a crash) for 10 s, then started again."""
    fleet = chaos.fleet
    fleet.postgres.stop()
    chaos.hold(10)
    fleet.postgres.start()
    chaos.lifted()
    fleet.publish()


def s3_down_during_publish(chaos: Chaos) -> None:
    """The S3 server is down for 30 s while the trainer publishes; the publish retries
    until the server is back."""
    fleet = chaos.fleet
    fleet.seaweed.stop()
    # The publish retries in a thread; the server restarts from this one (a child started
    # from a thread gets SIGTERM when that thread ends).
    publisher = threading.Thread(
        target=wait_until,
        args=(_publishes(fleet), 120 + 30 * chaos.scale, "a publish to go through", 0.5),
        daemon=True,
    )
    published = len(fleet.published)
    publisher.start()
    chaos.hold(30)
    fleet.seaweed.start()
    chaos.lifted()
    publisher.join()
    if len(fleet.published) == published:
        raise AssertionError("the publish never went through after S3 came back")


def s3_down_during_catch_up(chaos: Chaos) -> None:
    """A version is published, then the S3 server is down for 30 s while agents catch up."""
    fleet = chaos.fleet
    fleet.publish()
    fleet.seaweed.stop()
    chaos.hold(30)
    fleet.seaweed.start()
    chaos.lifted()


def engine_killed_mid_commit(chaos: Chaos) -> None:
    """An engine is killed (SIGKILL) while its agent stages and commits a new version, then
    restarted: it boots on v0 and its agent must bring it back to the latest version."""
    # Here, not at the top: every `tether` process loads this module, and the agent's
    # modules take a second or more to import on a busy machine.
    from engine_agent.agent import EXIT_UNRECOVERABLE

    fleet = chaos.fleet
    member = fleet.members[0]
    version = fleet.publish()

    def staging() -> bool:
        info = fleet.server_info(member) or {}
        return info.get("staging_target") == version or info.get("applied_version") == version

    wait_until(staging, 60, "the agent to start on the new version", 0.02)
    assert member.engine is not None and member.agent is not None
    agent = member.agent
    member.engine.kill()
    chaos.hold(2)
    fleet.start_engine(member)

    # A kill that lands inside the commit itself leaves the engine's weights undefined, so
    # the agent exits as terminal by design and the orchestrator replaces the replica. Play
    # the orchestrator's part, so recovery is checked whichever phase the kill hit.
    def settled() -> bool:
        info = fleet.server_info(member) or {}
        return not agent.alive() or info.get("applied_version") == version

    wait_until(settled, 60, f"the agent to commit v{version} or exit as terminal", 0.1)
    if not agent.alive():
        code = agent.process.returncode
        if code != EXIT_UNRECOVERABLE:
            raise AssertionError(f"the agent exited with {code}, not as terminal; log:\n"
                                 f"{agent.log_tail()}")  # fmt: skip
        log.warning("the kill hit the commit: the agent exited as terminal; replacing it")
        fleet.start_agent(member)
    chaos.lifted()


def agent_partitioned(chaos: Chaos) -> None:
    """The agent's link to the control plane is cut for 10 s (longer than its lease) while a
    version is published, then healed."""
    fleet = chaos.fleet
    assert fleet.proxy is not None
    fleet.proxy.partition()
    fleet.publish()
    chaos.hold(10)
    fleet.proxy.heal()
    chaos.lifted()


def publish_while_controlplane_down(chaos: Chaos) -> None:
    """The control plane is down while the trainer publishes (its notification cannot be
    delivered), and the trainer closes its publisher before the control plane is back."""
    fleet = chaos.fleet
    replica = fleet.replicas[0]
    fleet.kill_replica(replica)
    fleet.publish()
    fleet.close_publisher()
    chaos.hold(2)
    fleet.start_replica(replica)
    chaos.lifted()


def damaged_bytes_in_the_store(chaos: Chaos) -> None:
    """The store serves a version whose payload bytes are damaged: the agent must refuse
    it and report why, keep serving the version before, then take the next good one."""
    fleet = chaos.fleet
    member = fleet.members[0]
    before = fleet.latest
    bad = fleet.publish_damaged()

    def reported() -> dict[str, Any] | None:
        info = fleet.server_info(member) or {}
        return info if f"v{bad}" in str(info.get("last_error") or "") else None

    info = wait_until(reported, 60, f"the agent to refuse the damaged v{bad}", 0.1)
    if info["applied_version"] != before:
        raise AssertionError(f"the agent left v{before} for {info['applied_version']}")
    chaos.hold(3)
    fleet.publish_full_after(bad)
    chaos.lifted()


def staging_disk_full(chaos: Chaos) -> None:
    """The agent cannot write its staging folder (a file-size limit of 64 KiB, as a full
    disk would refuse the write) while a version is published; then the space comes back."""
    import resource

    import psutil

    fleet = chaos.fleet
    member = fleet.members[0]
    agent_process = member.agent
    assert agent_process is not None
    agent_alive = agent_process.alive
    agent = psutil.Process(agent_process.process.pid)
    unlimited = agent.rlimit(resource.RLIMIT_FSIZE)
    agent.rlimit(resource.RLIMIT_FSIZE, (64 * 1024, unlimited[1]))
    try:
        version = fleet.publish()

        def refused() -> bool:
            info = fleet.server_info(member) or {}
            return bool(info.get("last_error")) or not agent_alive()

        wait_until(refused, 60, f"the agent to fail staging v{version}", 0.1)
        if not agent_process.alive():
            raise AssertionError(f"the agent exited when staging v{version} did not fit")
        chaos.hold(5)
    finally:
        if agent_process.alive():
            agent.rlimit(resource.RLIMIT_FSIZE, unlimited)
    chaos.lifted()


def pin_on_a_collected_version(chaos: Chaos) -> None:
    """Under `keep_pinned`, one engine holds an older version for a client pinned to it;
    then `store gc` deletes that version. The pinned engine must follow latest again, and
    a request pinned to the deleted version is refused for good (not told to retry)."""
    fleet = chaos.fleet
    fleet.set_policy(KEEP_PINNED)
    pinned = fleet.publish()
    fleet.publish()
    wait_until(lambda: fleet.routable(pinned), 60, f"a request pinned to v{pinned} to be served")
    held = [
        m for m in fleet.members if (fleet.server_info(m) or {}).get("applied_version") == pinned
    ]
    if not held:
        raise AssertionError(f"no engine held v{pinned} for its pinned request")
    # A FULL version on top, so that gc may delete every version below it.
    latest = fleet.publish_full_after(fleet.latest)
    report = fleet.gc(keep=1)
    if pinned not in report.deleted:
        raise AssertionError(f"gc kept v{pinned}: {report}")
    chaos.lifted()
    error = wait_until(
        lambda: fleet.refused_for_good(pinned),
        60,
        f"a request pinned to the deleted v{pinned} to be refused for good",
        0.2,
    )
    if error.get("type") != "WeightVersionUnavailable":
        raise AssertionError(f"the deleted v{pinned} got {error}")
    fleet.wait_converged(latest)


def peer_serves_corrupted_bytes(chaos: Chaos) -> None:
    """A peer serves damaged bytes of a version to an engine that joins late: the newcomer
    must drop and report it, take the bytes from the store, and serve exactly what the
    other engine serves (no byte of the bad peer used)."""
    fleet = chaos.fleet
    holder, newcomer = fleet.members[0], fleet.members[1]
    assert newcomer.agent is not None and newcomer.engine is not None
    newcomer.agent.stop()
    newcomer.engine.stop()
    version = fleet.publish()
    wait_until(
        lambda: (fleet.server_info(holder) or {}).get("applied_version") == version,
        60,
        f"{holder.name} to serve v{version}",
        0.1,
    )
    # The holder's verified copies of the new version are damaged after the fact.
    cached = fleet.work / f"agent-{holder.name}" / "peer-files" / RUN / "updates"
    damaged = list(cached.glob(f"weight_v{version:06d}/*.safetensors"))
    if not damaged:
        raise AssertionError(f"{holder.name} kept no files of v{version} to serve")
    for path in damaged:
        path.write_bytes(_damaged(path.read_bytes()))
    chaos.lifted()
    fleet.start_member(newcomer)  # a fresh replica: its engine boots from v0
    fleet.wait_converged(version)
    faults = httpx.get(f"{newcomer.agent.url}/metrics", timeout=10.0).text
    if 'tether_agent_fetch_source_faults_total{reason="digest"}' not in faults:
        raise AssertionError(f"{newcomer.name} never met the damaged peer bytes")
    sums = {
        m.name: httpx.post(
            f"{m.engine.url}/weights_checker", json={"action": "checksum"}, timeout=30.0
        ).json()["message"]
        for m in (holder, newcomer)
        if m.engine is not None
    }
    if len(set(sums.values())) != 1:
        raise AssertionError(f"the engines serve different weights after the catch-up: {sums}")


def _damaged(data: bytes) -> bytes:
    """Flip the last 63 bytes: inside the payload, after the safetensors header."""
    out = bytearray(data)
    for i in range(1, min(64, len(out))):
        out[-i] ^= 0x5A
    return bytes(out)


def _publishes(fleet: ChaosFleet) -> Callable[[], bool]:
    def attempt() -> bool:
        try:
            fleet.publish()
        except Exception as exc:  # the store is away: retry until the deadline
            log.info("publish failed while S3 is down: %s", exc)
            return False
        return True

    return attempt


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Chaos], None]
    fleet: FleetSpec
    # The fault stops a control plane the clients talk to: refused connections are expected.
    # Otherwise every process the clients reach stays up, so none may reset a connection.
    cuts_client_links: bool = False


SCENARIOS: list[Scenario] = [
    Scenario("controlplane_kill9_sqlite", controlplane_kill9, FleetSpec(db="sqlite"), True),
    Scenario("controlplane_kill9_postgres", controlplane_kill9, FleetSpec(db="postgres"), True),
    Scenario("replica_killed", replica_killed, FleetSpec(db="postgres", replicas=2), True),
    Scenario("postgres_stopped_10s", postgres_stopped, FleetSpec(db="postgres")),
    Scenario("s3_down_30s_during_publish", s3_down_during_publish, FleetSpec(store="s3")),
    Scenario("s3_down_30s_during_catch_up", s3_down_during_catch_up, FleetSpec(store="s3")),
    Scenario("engine_killed_mid_commit", engine_killed_mid_commit, FleetSpec()),
    Scenario("agent_partitioned", agent_partitioned, FleetSpec(partitionable=True)),
    Scenario("publish_while_controlplane_down", publish_while_controlplane_down, FleetSpec(), True),
    Scenario("damaged_bytes_in_the_store", damaged_bytes_in_the_store, FleetSpec()),
    Scenario("staging_disk_full", staging_disk_full, FleetSpec()),
    Scenario("pin_on_a_collected_version", pin_on_a_collected_version, FleetSpec(engines=2)),
    Scenario("peer_serves_corrupted_bytes", peer_serves_corrupted_bytes, FleetSpec(engines=2)),
]


@dataclass
class ScenarioResult:
    name: str
    passed: bool
    requests: int
    completed: int
    retryable_failures: int
    # Attempts that met a refused or reset connection (retried, so not lost): a killed
    # process explains them; a database outage, where every process stays up, must not.
    transport_errors: int
    requests_lost: int
    constraint_violations: int
    recovery_s: float | None
    data_lost: int
    seconds: float
    problems: list[str] = field(default_factory=list)


def run_scenario(
    scenario: Scenario,
    work: Path,
    scale: float = 1.0,
    request_deadline_s: float = 30.0,
    converge_deadline_s: float = CONVERGE_DEADLINE_S,
) -> ScenarioResult:
    """Start the scenario's fleet, run the load around its fault, judge what happened."""
    began = time.monotonic()
    problems: list[str] = []
    with ChaosFleet(work, scenario.fleet) as fleet:
        chaos = Chaos(fleet, scale)
        load = PinnedLoad(
            lambda: fleet.urls, fleet.tokens["client"], lambda: fleet.latest,
            deadline_s=request_deadline_s,
        )  # fmt: skip
        with load:
            wait_until(lambda: any(r.outcome == "ok" for r in load.records), 60, "a first answer")
            try:
                scenario.run(chaos)
            except Exception as exc:
                problems.append(f"the fault could not be run through: {exc}")
            lifted = chaos.fault_lifted or time.monotonic()
            try:
                fleet.wait_converged(fleet.latest, converge_deadline_s)
            except DeadlineExceeded as exc:
                problems.append(f"no convergence: {exc}")
            # Keep the load on until a request sent after the fault has come back.
            try:
                wait_until(
                    lambda: any(r.outcome == "ok" and r.started >= lifted for r in load.records),
                    request_deadline_s,
                    "a request sent after the fault to succeed",
                )
            except DeadlineExceeded as exc:
                problems.append(str(exc))
        records = list(load.records)
        data_lost = fleet.data_lost()
    after = [r for r in records if r.outcome == "ok" and r.started >= lifted]
    recovery = round(min(r.ended for r in after) - lifted, 3) if after else None
    lost = [r for r in records if r.outcome == "lost"]
    violations = [r for r in records if r.outcome == "violation"]
    for record in (lost + violations)[:3]:
        problems.append(f"{record.outcome}: {record.constraint} -> {record.detail}")
    if data_lost:
        problems.append(f"versions that no longer verify: {data_lost}")
    return ScenarioResult(
        name=scenario.name,
        passed=not problems and recovery is not None,
        requests=len(records),
        completed=sum(r.outcome == "ok" for r in records),
        retryable_failures=sum(r.outcome == "retryable_failure" for r in records),
        transport_errors=sum(r.transport_errors for r in records),
        requests_lost=len(lost),
        constraint_violations=len(violations),
        recovery_s=recovery,
        data_lost=len(data_lost),
        seconds=round(time.monotonic() - began, 1),
        problems=problems,
    )


def summarize(results: list[ScenarioResult]) -> dict[str, Any]:
    """The figures of the last JSON line."""
    recoveries = [r.recovery_s for r in results if r.recovery_s is not None]
    return {
        "scenarios": len(results),
        "scenarios_passed": sum(r.passed for r in results),
        "requests_lost": sum(r.requests_lost for r in results),
        "constraint_violations": sum(r.constraint_violations for r in results),
        "max_recovery_s": max(recoveries) if recoveries else None,
        "data_lost": sum(r.data_lost for r in results),
        "per_scenario": [asdict(r) for r in results],
    }


def run(
    only: list[str] = typer.Option(None, "--only", help="run just these scenarios (repeatable)"),
    scale: float = typer.Option(1.0, help="multiplies every fault's length (1: as specified)"),
    request_deadline_s: float = typer.Option(30.0, help="how long one request may retry"),
    keep: bool = typer.Option(False, help="keep the work folder (logs) afterwards"),
) -> None:
    """Fault scenarios against real processes under a pinned load; one JSON line at the end."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    chosen = [s for s in SCENARIOS if not only or s.name in only]
    unknown = set(only or ()) - {s.name for s in SCENARIOS}
    if unknown:
        console.print(
            f"unknown scenario(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}"
        )
        raise typer.Exit(2)
    work = Path(tempfile.mkdtemp(prefix="tether-bench-chaos-"))
    results = []
    try:
        for scenario in chosen:
            console.print(f"[bold]{scenario.name}[/bold] ...")
            result = run_scenario(scenario, work / scenario.name, scale, request_deadline_s)
            results.append(result)
            for problem in result.problems:
                console.print(f"  [red]{problem}[/red]")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    table = Table("scenario", "passed", "requests", "lost", "violations", "retryable fails",
                  "transport errors", "recovery s", "data lost", "seconds")  # fmt: skip
    for r in results:
        table.add_row(r.name, "yes" if r.passed else "NO", str(r.requests), str(r.requests_lost),
                      str(r.constraint_violations), str(r.retryable_failures),
                      str(r.transport_errors), str(r.recovery_s), str(r.data_lost),
                      str(r.seconds))  # fmt: skip
    console.print(table)
    summary = summarize(results)
    print(json.dumps(summary))
    if summary["scenarios_passed"] != summary["scenarios"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(run)
