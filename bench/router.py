"""Router benchmark: added latency and throughput of Tether's router against SGLang's.

Side by side on one machine: requests straight to fast engine stand-ins, through Tether's
router (its own hot-lane exchange, one process and any `--workers` counts asked for; and
the same lane through ASGI, `tether-asgi`, as before the exchange), in the client-side
route mode (`tether-route`: `GET /v1/route`, then the engine directly), with the direct
client (`tether-direct`: `GET /v1/routes` cached for its `valid_for_s`, power-of-two
choices by the client's own in-flight counts, then the engine directly), and through
SGLang's Rust router (`sglang-router`) to the same stand-ins. For each router, the CPU time of its
process tree per request during the throughput runs. Also the routing decision time with
1,000 registered engines, and heartbeat latency with 1,000 simulated engines at 1 Hz on
SQLite and on PostgreSQL (`--pg-url`, else a server started from the machine's
initdb/pg_ctl for the run). The last line printed is one JSON object of the figures.

Method: a bare asyncio HTTP/1.1 keep-alive client (the servers share the machine with
it). Added latency is the difference of medians of sequential requests (one in flight),
interleaved across the paths round by round so drift cancels; throughput is measured
separately with `--concurrency` connections, the paths alternating over `--rounds` rounds
(the order rotating), with each round's Tether / Rust ratio in the figures.

Run: `tether bench router` or `python -m bench.router --samples 2000 --requests 2000`.
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer

from launcher.processes import TETHER, ManagedProcess, ProcessFailed, ProcessGroup, free_port

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "tth_bench-admin-token-not-secret"
START_DEADLINE_S = 120.0
# The stand-ins beat as often as agents do (the control plane's default
# `heartbeat_interval_s`); their heartbeats are work of the measured router, not of the Rust one.
AGENT_HEARTBEAT_S = 2.0
# Heartbeat runs measure latency; a lease lapsing under a loaded machine would end them.
LONG_LEASE = {"TETHER_LEASE_SECONDS": "120"}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _start_controlplane(
    procs: ProcessGroup,
    db_url: str,
    store: Path,
    workers: int = 1,
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    port = free_port()
    argv = [TETHER, "controlplane", "serve", "--db", db_url, "--store", str(store),
            "--port", str(port), "--log-level", "warning", "--workers", str(workers)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return procs.start(
        f"controlplane-{port}",
        argv,
        env={"TETHER_ADMIN_TOKEN": ADMIN, **(env or {})},
        url=url,
        cwd=ROOT,
    ).wait_http("/readyz", START_DEADLINE_S)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and all its descendants so far."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _publish(store: Path, cp: str, run_id: str, version: int, new_run: bool = True) -> None:
    """Lay out `version` of `run_id` in the store and record it (creating the run first
    unless `new_run` is False)."""
    import httpx

    name = f"weight_v{version:06d}"
    folder = store / run_id / "updates" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}')
    (store / run_id / "latest").write_text(f"{run_id}/{name}")
    headers = {"Authorization": f"Bearer {ADMIN}"}
    if new_run:
        httpx.post(f"{cp}/v1/runs", json={"run_id": run_id}, headers=headers).raise_for_status()
    httpx.post(
        f"{cp}/v1/runs/{run_id}/versions", json={"version": version}, headers=headers
    ).raise_for_status()


class RawConnection:
    """One HTTP/1.1 keep-alive connection speaking just enough of the protocol to post.

    A full-featured Python client costs more CPU per request than the servers it measures,
    and on a 2-core machine that CPU is taken from them; this one costs a few tens of µs.
    Replies may carry Content-Length or chunked transfer encoding.
    """

    def __init__(self, reader: Any, writer: Any, host: str, headers: dict[str, str]) -> None:
        self.reader = reader
        self.writer = writer
        self.prefix = f"HTTP/1.1\r\nHost: {host}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()
        )

    @classmethod
    async def open(cls, url: str, headers: dict[str, str] | None = None) -> RawConnection:
        import asyncio
        from urllib.parse import urlsplit

        where = urlsplit(url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, where.netloc, headers or {})

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} {self.prefix}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        return await self._answer(f"POST {path}")

    async def get(self, path: str) -> tuple[int, bytes]:
        self.writer.write(f"GET {path} {self.prefix}\r\n".encode())
        return await self._answer(f"GET {path}")

    async def _answer(self, what: str) -> tuple[int, bytes]:
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError(f"connection closed before answering {what}")
        status = int(status_line.split()[1])
        length, chunked = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if not chunked:
            return status, await self.reader.readexactly(length)
        parts = []
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            parts.append(await self.reader.readexactly(size))
            await self.reader.readline()
        await self.reader.readline()
        return status, b"".join(parts)

    def close(self) -> None:
        self.writer.close()


class RoutedConnection:
    """The client-side route mode: ask the router which engine (`GET /v1/route`), then
    post to that engine directly on a kept connection of its own. The router sees one
    small request per generate request and never carries the prompt or the answer."""

    def __init__(self, router: RawConnection, query: str) -> None:
        self.router = router
        self.query = query
        self.engines: dict[str, RawConnection] = {}

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        status, reply = await self.router.get(self.query)
        if status != 200:
            return status, reply
        url = json.loads(reply)["url"]
        conn = self.engines.get(url)
        if conn is None:
            conn = self.engines[url] = await RawConnection.open(url)
        return await conn.post(path, body)

    def close(self) -> None:
        self.router.close()
        for conn in self.engines.values():
            conn.close()


class DirectClient:
    """The direct client's shared state, as `trainer_client.DirectRoutes` keeps it: one
    cached candidate set (`GET /v1/routes`), asked again when its `valid_for_s` lapses
    (one ask at a time), and the client's in-flight requests per engine."""

    def __init__(self, query: str) -> None:
        import asyncio
        import random

        self.query = query
        self.engines: list[Any] = []
        self.expires_at = 0.0
        self.in_flight: dict[str, int] = {}
        self.lookups = 0
        self.rng = random.Random()
        self._asking = asyncio.Lock()

    async def candidates(self, router: RawConnection) -> list[Any]:
        from wire import RouteSet

        if time.monotonic() < self.expires_at:
            return self.engines
        async with self._asking:
            if time.monotonic() < self.expires_at:
                return self.engines
            status, reply = await router.get(self.query)
            if status != 200:
                raise RuntimeError(f"GET {self.query} answered {status}: {reply[:200]!r}")
            found = RouteSet.model_validate_json(reply)
            self.lookups += 1
            self.engines, self.expires_at = found.engines, time.monotonic() + found.valid_for_s
        return self.engines


class DirectConnection:
    """One connection of the direct client: the router connection for candidate sets
    (shared state in `DirectClient`), and a kept connection per engine it posts to."""

    def __init__(self, router: RawConnection, client: DirectClient) -> None:
        self.router = router
        self.client = client
        self.engines: dict[str, RawConnection] = {}

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        from trainer_client.direct_routes import pick_less_loaded

        client = self.client
        engine = pick_less_loaded(
            await client.candidates(self.router), client.in_flight, client.rng
        )
        assert engine is not None  # the control plane refuses rather than list none
        conn = self.engines.get(engine.url)
        if conn is None:
            conn = self.engines[engine.url] = await RawConnection.open(engine.url)
        client.in_flight[engine.engine_id] = client.in_flight.get(engine.engine_id, 0) + 1
        try:
            return await conn.post(path, body)
        finally:
            client.in_flight[engine.engine_id] -= 1

    def close(self) -> None:
        self.router.close()
        for conn in self.engines.values():
            conn.close()


Connection = RawConnection | RoutedConnection | DirectConnection


GENERATE_BODY = json.dumps(
    {"text": "hello", "weight_version": {"min_version": 1}, "sampling_params": {}}
).encode()


class Target:
    """One way to reach the stand-ins: base URLs (connections spread over them), the
    generate path, the request headers, and the router's process (None: no router), whose
    CPU time (with its children's) is counted while its throughput is measured."""

    def __init__(
        self,
        name: str,
        bases: list[str],
        path: str,
        headers: dict[str, str],
        pid: int | None = None,
        route_query: str | None = None,
        direct: DirectClient | None = None,
    ) -> None:
        self.name, self.bases, self.path, self.headers = name, bases, path, headers
        self.pid = pid
        # Set: the client-side route mode (`RoutedConnection`) with this `/v1/route` query.
        self.route_query = route_query
        # Set: the direct client (`DirectConnection`) with this shared state.
        self.direct = direct

    async def connect(self, i: int = 0) -> Connection:
        conn = await RawConnection.open(self.bases[i % len(self.bases)], self.headers)
        if self.direct is not None:
            return DirectConnection(conn, self.direct)
        return RoutedConnection(conn, self.route_query) if self.route_query else conn


async def _call(conn: Connection, path: Target) -> float:
    start = time.perf_counter()
    status, reply = await conn.post(path.path, GENERATE_BODY)
    took = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"{path.name} answered {status}: {reply[:200]!r}")
    return took


async def _latencies(paths: list[Target], samples: int) -> dict[str, list[float]]:
    """Sequential requests (one in flight), interleaved across paths round by round.

    Each round sends one request on every path, in an order that rotates, so load from
    elsewhere on the machine and slow drift touch every path alike and cancel in the
    differences of medians.
    """
    conns = [await p.connect() for p in paths]
    for conn, p in zip(conns, paths, strict=True):  # warm up each path
        for _ in range(20):
            await _call(conn, p)
    out: dict[str, list[float]] = {p.name: [] for p in paths}
    for i in range(samples):
        k = i % len(paths)
        for conn, p in (
            list(zip(conns, paths, strict=True))[k:] + list(zip(conns, paths, strict=True))[:k]
        ):
            out[p.name].append(await _call(conn, p))
    for conn in conns:
        conn.close()
    return out


async def _throughput(path: Target, requests: int, concurrency: int) -> tuple[float, float]:
    """Wall seconds and router CPU seconds (0 without a router) for `requests` requests
    with `concurrency` keep-alive connections kept busy."""
    import asyncio

    conns = [await path.connect(i) for i in range(concurrency)]
    await asyncio.gather(*(_call(c, path) for c in conns))
    counter = iter(range(requests))

    async def worker(conn: Connection) -> None:
        for _ in counter:
            await _call(conn, path)

    cpu_before = _cpu_seconds(path.pid) if path.pid else 0.0
    begin = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - begin
    cpu = _cpu_seconds(path.pid) - cpu_before if path.pid else 0.0
    for conn in conns:
        conn.close()
    return elapsed, cpu


async def _compare(
    paths: list[Target], samples: int, requests: int, concurrency: int, rounds: int = 2
) -> dict[str, dict[str, Any]]:
    """Latency at concurrency 1 (interleaved), then throughput, alternating paths."""
    lat = await _latencies(paths, samples)
    done = {p.name: 0.0 for p in paths}
    cpu = {p.name: 0.0 for p in paths}
    by_round: dict[str, list[float]] = {p.name: [] for p in paths}
    for r in range(rounds):
        # The order rotates each round, so no path always follows the same one.
        for p in paths[r % len(paths) :] + paths[: r % len(paths)]:
            wall, used = await _throughput(p, requests, concurrency)
            done[p.name] += wall
            cpu[p.name] += used
            by_round[p.name].append(requests / wall)
    return {
        p.name: {
            "rps": rounds * requests / done[p.name],
            "cpu_us": cpu[p.name] / (rounds * requests) * 1e6,
            "p50_ms": statistics.median(lat[p.name]) * 1e3,
            "p99_ms": _percentile(lat[p.name], 0.99) * 1e3,
            "rps_by_round": by_round[p.name],
        }
        for p in paths
    }


def _start_rust_router(
    procs: ProcessGroup, engines: list[str]
) -> tuple[ManagedProcess | None, str | None]:
    """Start SGLang's Rust router; return (its process, None) or (None, why not)."""
    try:
        import sglang_router  # noqa: F401
    except ImportError as exc:
        return None, f"sglang-router is not installed ({exc}); pip install sglang-router"
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *engines,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--log-level", "warn"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        router = procs.start("sglang-router", argv, url=url, cwd=ROOT).wait_http("/readiness", 60)
    except ProcessFailed as exc:
        return None, f"sglang-router did not start: {exc}"
    return router, None


def _decision_time(engines: int) -> float:
    """Mean microseconds per routing decision over `engines` ready engines, in process."""
    from controlplane.router import pick
    from controlplane.snapshot import EngineView, FleetSnapshot, RunView
    from store.types import VersionConstraint
    from wire import Precision, SyncState, TargetPolicy

    now = time.time()
    views = [
        EngineView(f"e{i:04d}", "run", f"http://10.0.{i // 250}.{i % 250}:8000",
                   list(Precision)[i % 3], 8, i % 20, SyncState.READY, i % 7,
                   None, 0.0, None, now + 3600)
        for i in range(engines)
    ]  # fmt: skip
    snap = FleetSnapshot.build(now, views, [RunView("run", 19, None, TargetPolicy())], {})
    constraints = [VersionConstraint(min_version=10), VersionConstraint(exact_version=15)]
    n = 20_000
    start = time.perf_counter()
    for i in range(n):
        pick(snap, "run", constraints[i & 1], now=now, local_in_flight={})
    return (time.perf_counter() - start) / n * 1e6


def _fresh_pg_database(pg_url: str) -> tuple[str, Any]:
    """A new, empty database on the server behind `pg_url`, and a function that drops it.

    Every run measures heartbeats against its own 1,000 engines only, never against the
    stale rows of an earlier run.
    """
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    from controlplane.db import normalise_url

    url = make_url(normalise_url(pg_url))
    name = f"tether_bench_{uuid.uuid4().hex[:12]}"
    admin = url.set(drivername="postgresql", database="postgres").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return url.set(database=name).render_as_string(False), drop


def _heartbeats(cp: str, engines: int, seconds: float, connections: int = 50) -> float:
    """p99 heartbeat latency (ms) with `engines` engines beating once a second each."""
    import asyncio

    import httpx

    headers = {"Authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{cp}/v1/runs", json={"run_id": "hb"}, headers=headers)

    async def main() -> float:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=cp, headers=headers, limits=limits, timeout=30) as c:
            ids: list[str] = []
            sem = asyncio.Semaphore(64)

            async def register(i: int) -> None:
                async with sem:
                    body = {
                        "url": f"http://10.1.{i // 250}.{i % 250}:8000",
                        "run_id": "hb",
                        "precision": "bf16",
                        "applied_version": 0,
                        "sync_state": "ready",
                    }
                    reply = await c.post("/v1/engines", json=body)
                    reply.raise_for_status()
                    ids.append(reply.json()["engine_id"])

            await asyncio.gather(*(register(i) for i in range(engines)))
        latencies: list[float] = []
        loop = asyncio.get_running_loop()
        begin = loop.time() + 0.5

        async def connection(slot: int) -> None:
            conn = await RawConnection.open(cp, headers)
            mine = [(k / engines, ids[k]) for k in range(slot, engines, connections)]
            for tick in range(int(seconds)):
                for offset, engine_id in mine:
                    await asyncio.sleep(max(0.0, begin + tick + offset - loop.time()))
                    body = json.dumps(
                        {"applied_version": 0, "sync_state": "ready", "in_flight": tick % 4}
                    ).encode()
                    start = time.perf_counter()
                    status, _ = await conn.post(f"/v1/engines/{engine_id}/heartbeat", body)
                    latencies.append(time.perf_counter() - start)
                    if status != 200:
                        raise RuntimeError(f"heartbeat of {engine_id} answered {status}")
            conn.close()

        await asyncio.gather(*(connection(i) for i in range(min(connections, engines))))
        return _percentile(latencies, 0.99) * 1e3

    return asyncio.run(main())


def _tether_name(workers: int) -> str:
    return "tether" if workers == 1 else f"tether-{workers}w"


# The control plane as it was before its own hot-lane exchange: every hot request through
# an ASGI cycle (the same answers), measured beside the current one.
ASGI_ENTRY = "tether-asgi"
# The client asks the router for an engine and calls it itself (`RoutedConnection`).
ROUTE_MODE = "tether-route"
# The client balances over a cached candidate set and calls engines itself (`DirectConnection`).
DIRECT_CLIENT = "tether-direct"


def _own_postgres() -> tuple[str | None, Any, str | None]:
    """A PostgreSQL server of the machine's binaries for the heartbeat figure: (its URL,
    a function that removes it, None) or (None, None, why not)."""
    from launcher.postgres import PostgresServer, find_pg_bin

    if find_pg_bin() is None:
        return None, None, "PostgreSQL binaries (initdb, pg_ctl) are not installed"
    server = PostgresServer.create()
    try:
        server.start()
    except Exception:
        server.remove()
        raise
    return server.url(), server.remove, None


def run(
    samples: int = typer.Option(2000, help="sequential requests per path for added latency"),
    requests: int = typer.Option(2000, help="requests per path and round for throughput"),
    concurrency: int = typer.Option(16, help="requests in flight at once"),
    engines: int = typer.Option(2, help="engine stand-ins behind the routers"),
    workers: list[int] = typer.Option(
        [1],
        help="control-plane processes behind Tether's port; repeat to measure several "
        "configurations side by side (the last one is compared to the Rust router)",
    ),
    asgi_entry: bool = typer.Option(
        True, help=f"also measure the hot lane through ASGI ('{ASGI_ENTRY}', 1 process)"
    ),
    route_mode: bool = typer.Option(
        True,
        help=f"also measure the client-side route mode ('{ROUTE_MODE}': GET /v1/route, then "
        "straight to the engine)",
    ),
    direct_client: bool = typer.Option(
        True,
        help=f"also measure the direct client ('{DIRECT_CLIENT}': GET /v1/routes cached for "
        "its valid_for_s, power-of-two choices on the client, straight to the engine)",
    ),
    rounds: int = typer.Option(
        2, help="throughput rounds, the paths alternating (more: drifting load cancels better)"
    ),
    fleet: int = typer.Option(1000, help="engines for the decision and heartbeat figures"),
    heartbeat_seconds: float = typer.Option(
        10, help="seconds of 1 Hz heartbeats to measure (0: skip the heartbeat figures)"
    ),
    pg_url: str = typer.Option(
        None,
        help="PostgreSQL server for the heartbeat figure (default: start one from the "
        "machine's initdb/pg_ctl for the run)",
    ),
) -> None:
    """Tether's router vs direct vs SGLang's Rust router; decisions and heartbeats at scale."""
    import asyncio

    from rich.console import Console
    from rich.table import Table

    console = Console()
    work = Path(tempfile.mkdtemp(prefix="tether-bench-router-"))
    procs = ProcessGroup(work)
    figures: dict[str, Any] = {}
    configs = list(dict.fromkeys(workers))  # each configuration once, in the order given
    if not configs or min(configs) < 1:
        raise typer.BadParameter("each --workers must be 1 or more", param_hint="--workers")
    if rounds < 1:
        raise typer.BadParameter("--rounds must be 1 or more", param_hint="--rounds")
    remove_postgres = None
    try:
        store = work / "store"
        store.mkdir()
        # Every Tether configuration reads the same database (the stand-ins register and
        # heartbeat with the first); each builds its own fleet snapshot from it.
        db_url = f"sqlite:///{work / 'cp.db'}"
        planes = {_tether_name(n): _start_controlplane(procs, db_url, store, n) for n in configs}
        if asgi_entry:
            planes[ASGI_ENTRY] = _start_controlplane(
                procs, db_url, store, 1, {"TETHER_HOT_EXCHANGE": "0"}
            )
        cp = planes[_tether_name(configs[0])].url
        assert cp is not None
        _publish(store, cp, "bench", 1)
        import httpx

        admin = {"Authorization": f"Bearer {ADMIN}"}
        minted = httpx.post(f"{cp}/v1/tokens", json={"role": "engine"}, headers=admin)
        engine_token = minted.json()["token"]
        urls = []
        for i in range(engines):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            procs.start(f"engine{i}", [sys.executable, "-m", "tests.standins.engine",
                        "--port", str(port), "--version", "1", "--controlplane", cp,
                        "--token", engine_token, "--run-id", "bench",
                        "--heartbeat-s", str(AGENT_HEARTBEAT_S)],
                        url=urls[-1], cwd=ROOT).wait_http("/health", START_DEADLINE_S)  # fmt: skip
        deadline = time.monotonic() + 30
        headers = {"Authorization": f"Bearer {ADMIN}"}
        while len(httpx.get(f"{cp}/v1/engines", headers=headers).json()["engines"]) < engines:
            if time.monotonic() > deadline:
                raise RuntimeError("engine stand-ins did not register")
            time.sleep(0.1)
        time.sleep(1.0)  # let every process's snapshot see the fleet

        rust, why = _start_rust_router(procs, urls)
        if why:
            console.print(f"[yellow]SGLang Rust router skipped:[/yellow] {why}")
        targets = [Target("direct", urls, "/generate", {})]
        for name, plane in planes.items():
            assert plane.url is not None
            targets.append(Target(name, [plane.url], "/v1/generate", headers, plane.process.pid))
        if route_mode:
            plane = planes[_tether_name(configs[-1])]
            assert plane.url is not None
            targets.append(Target(ROUTE_MODE, [plane.url], "/generate", headers,
                                  plane.process.pid, "/v1/route?min_version=1"))  # fmt: skip
        direct_state = DirectClient("/v1/routes?min_version=1")
        if direct_client:
            plane = planes[_tether_name(configs[-1])]
            assert plane.url is not None
            targets.append(Target(DIRECT_CLIENT, [plane.url], "/generate", headers,
                                  plane.process.pid, direct=direct_state))  # fmt: skip
        if rust is not None:
            assert rust.url is not None
            targets.append(Target("sglang-router", [rust.url], "/generate", {}, rust.process.pid))
        console.print(
            f"[bold]router[/bold]: {samples} sequential requests per path, interleaved; "
            f"then {requests} requests x {len(targets)} paths x 2 rounds, {concurrency} in flight"
        )
        found = asyncio.run(_compare(targets, samples, requests, concurrency, rounds))
        direct, rust_found = found["direct"], found.get("sglang-router")
        tether = found[_tether_name(configs[-1])]

        table = Table(
            "path", "req/s", "router CPU µs/req", "p50 ms (1 in flight)", "p99 ms",
            "p50 added ms", "p99 added ms",
        )  # fmt: skip
        for t in targets:
            r = found[t.name]
            table.add_row(
                t.name,
                f"{r['rps']:.0f}",
                f"{r['cpu_us']:.0f}" if t.pid else "-",
                f"{r['p50_ms']:.3f}",
                f"{r['p99_ms']:.3f}",
                f"{r['p50_ms'] - direct['p50_ms']:.3f}",
                f"{r['p99_ms'] - direct['p99_ms']:.3f}",
            )
        if rust_found is None:
            table.add_row("sglang-router", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a")
        console.print(table)
        figures.update(
            router_rps=round(tether["rps"], 1),
            direct_rps=round(direct["rps"], 1),
            rust_rps=round(rust_found["rps"], 1) if rust_found else None,
            router_cpu_us_per_request=round(tether["cpu_us"], 1),
            rust_cpu_us_per_request=round(rust_found["cpu_us"], 1) if rust_found else None,
            router_rps_by_workers={
                str(n): round(found[_tether_name(n)]["rps"], 1) for n in configs
            },
            router_cpu_us_by_workers={
                str(n): round(found[_tether_name(n)]["cpu_us"], 1) for n in configs
            },
            asgi_entry_rps=round(found[ASGI_ENTRY]["rps"], 1) if asgi_entry else None,
            asgi_entry_cpu_us_per_request=(
                round(found[ASGI_ENTRY]["cpu_us"], 1) if asgi_entry else None
            ),
            asgi_entry_rps_over_rust=(
                round(found[ASGI_ENTRY]["rps"] / rust_found["rps"], 3)
                if asgi_entry and rust_found
                else None
            ),
            direct_p50_ms=round(direct["p50_ms"], 3),
            router_p50_added_ms=round(tether["p50_ms"] - direct["p50_ms"], 3),
            router_p99_added_ms=round(tether["p99_ms"] - direct["p99_ms"], 3),
            rust_p50_added_ms=(
                round(rust_found["p50_ms"] - direct["p50_ms"], 3) if rust_found else None
            ),
            rust_p99_added_ms=(
                round(rust_found["p99_ms"] - direct["p99_ms"], 3) if rust_found else None
            ),
            router_rps_over_rust=(
                round(tether["rps"] / rust_found["rps"], 3) if rust_found else None
            ),
            rust_skipped_reason=why,
            route_mode_rps=round(found[ROUTE_MODE]["rps"], 1) if route_mode else None,
            route_mode_cpu_us_per_request=(
                round(found[ROUTE_MODE]["cpu_us"], 1) if route_mode else None
            ),
            direct_client_rps=(round(found[DIRECT_CLIENT]["rps"], 1) if direct_client else None),
            direct_client_cpu_us_per_request=(
                round(found[DIRECT_CLIENT]["cpu_us"], 1) if direct_client else None
            ),
            direct_client_route_lookups=direct_state.lookups if direct_client else None,
            direct_client_rps_over_rust=(
                round(found[DIRECT_CLIENT]["rps"] / rust_found["rps"], 3)
                if direct_client and rust_found
                else None
            ),
            direct_client_over_rust_by_round=(
                [
                    round(ours / theirs, 3)
                    for ours, theirs in zip(
                        found[DIRECT_CLIENT]["rps_by_round"],
                        rust_found["rps_by_round"],
                        strict=True,
                    )
                ]
                if direct_client and rust_found
                else None
            ),
            router_over_rust_by_round=(
                [
                    round(ours / theirs, 3)
                    for ours, theirs in zip(
                        tether["rps_by_round"], rust_found["rps_by_round"], strict=True
                    )
                ]
                if rust_found
                else None
            ),
        )
        if rust_found:
            console.print(
                f"Tether ({_tether_name(configs[-1])}) / Rust router throughput: "
                f"{figures['router_rps_over_rust']:.2f}x"
            )
            if direct_client:
                console.print(
                    f"Direct client ({DIRECT_CLIENT}) / Rust router throughput: "
                    f"{figures['direct_client_rps_over_rust']:.2f}x"
                )

        figures["route_decision_us_1000"] = round(_decision_time(fleet), 2)
        console.print(f"routing decision, {fleet} engines: {figures['route_decision_us_1000']} us")

        figures["heartbeat_p99_ms_sqlite"] = figures["heartbeat_p99_ms_postgres"] = None
        figures["postgres_skipped_reason"] = None
        server_url: str | None = pg_url
        if heartbeat_seconds > 0:
            hb_cp = _start_controlplane(procs, f"sqlite:///{work / 'hb.db'}", store, env=LONG_LEASE)
            assert hb_cp.url is not None
            figures["heartbeat_p99_ms_sqlite"] = round(
                _heartbeats(hb_cp.url, fleet, heartbeat_seconds), 2
            )
            console.print(
                f"heartbeat p99, {fleet} engines at 1 Hz, SQLite: "
                f"{figures['heartbeat_p99_ms_sqlite']} ms"
            )
            if not server_url:
                server_url, remove_postgres, figures["postgres_skipped_reason"] = _own_postgres()
        if heartbeat_seconds > 0 and server_url:
            fresh_url, drop_database = _fresh_pg_database(server_url)
            try:
                pg_cp = _start_controlplane(procs, fresh_url, store, env=LONG_LEASE)
                assert pg_cp.url is not None
                figures["heartbeat_p99_ms_postgres"] = round(
                    _heartbeats(pg_cp.url, fleet, heartbeat_seconds), 2
                )
            finally:
                procs.stop_all()
                drop_database()
            console.print(f"heartbeat p99, PostgreSQL: {figures['heartbeat_p99_ms_postgres']} ms")
        elif heartbeat_seconds > 0:
            console.print(
                "[yellow]PostgreSQL heartbeat figure skipped:[/yellow] "
                f"{figures['postgres_skipped_reason']}"
            )
    finally:
        procs.stop_all()
        if remove_postgres is not None:
            remove_postgres()
        shutil.rmtree(work, ignore_errors=True)
    figures.update(
        workers=configs[-1],
        rounds=rounds,
        samples=samples,
        requests=requests,
        concurrency=concurrency,
        engines=engines,
        fleet=fleet,
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    typer.run(run)
