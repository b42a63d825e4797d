"""Two control-plane replicas on one PostgreSQL, through what goes wrong between them.

- A version notified on one replica reaches the other one's fleet view at once, woken over
  LISTEN/NOTIFY, not by its periodic refresh (set to an hour here); so does an engine
  deregistered on one replica (the other stops routing to it).
- PostgreSQL stopped for longer than a lease: routes that need the database answer 503
  with Retry-After in the JSON error shape, the router keeps serving from its last fleet
  view and the last known token roles, nothing logs a traceback, and the engine keeps its
  registration (its lease is renewed on recovery instead of lapsing).

The PostgreSQL server is this module's own, so a test can stop and start it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launcher.postgres import PostgresServer, find_pg_bin
from launcher.processes import TETHER, ManagedProcess, ProcessGroup, free_port, wait_until
from tests.controlplane.conftest import ADMIN, publish

pytestmark = pytest.mark.postgres

DEADLINE_S = 30.0
LEASE_S = 3.0


@dataclass
class Replica:
    url: str
    process: ManagedProcess

    def call(self, method: str, path: str, token: str = ADMIN, **kwargs: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=30.0, **kwargs)


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    if find_pg_bin() is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) are not installed")
    found = PostgresServer.create()
    try:
        yield found.start()
    finally:
        found.remove()


StartPair = Callable[[dict[str, str]], tuple[Replica, Replica, Path]]


@pytest.fixture
def start_pair(server: PostgresServer, tmp_path: Path) -> Iterator[StartPair]:
    """Starts replicas A and B (with `env` settings) on a fresh database of `server`."""
    group = ProcessGroup(tmp_path / "logs")

    def start(env: dict[str, str]) -> tuple[Replica, Replica, Path]:
        store = tmp_path / "store"
        store.mkdir()
        db = server.create_database(f"faults_{uuid.uuid4().hex[:12]}")
        migrated = subprocess.run(
            [TETHER, "controlplane", "migrate", "--db", db], capture_output=True, text=True
        )
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        replicas = []
        for name in ("a", "b"):
            port = free_port()
            argv = [TETHER, "controlplane", "serve", "--db", db, "--store", str(store),
                    "--port", str(port), "--no-migrate", "--log-level", "warning"]  # fmt: skip
            process = group.start(
                f"replica-{name}",
                argv,
                env={"TETHER_ADMIN_TOKEN": ADMIN, **env},
                url=f"http://127.0.0.1:{port}",
            )
            replicas.append(process)
        for process in replicas:
            process.wait_http("/readyz", deadline_s=60.0)
        a, b = (Replica(p.url or "", p) for p in replicas)
        return a, b, store

    with group:
        yield start
    # A test that stopped the server and failed half way leaves it stopped; pg_ctl refuses
    # to start a running one.
    with contextlib.suppress(subprocess.CalledProcessError):
        server.start()


def notify(replica: Replica, store: Path, run_id: str, version: int) -> None:
    publish(store, run_id, version)
    reply = replica.call("POST", f"/v1/runs/{run_id}/versions", json={"version": version})
    assert reply.status_code == 201, reply.text


def engine_on_a_pair(start_pair: StartPair, run_id: str) -> tuple[Replica, Replica, Path, str]:
    """Replicas A and B that read the fleet only when told to (by a NOTIFY: their periodic
    refresh is an hour), run `run_id` at v1 and a ready engine on it, registered through A."""
    a, b, store = start_pair({"TETHER_SNAPSHOT_REFRESH_S": "3600", "TETHER_LEASE_SECONDS": "600"})
    assert a.call("POST", "/v1/runs", json={"run_id": run_id}).status_code == 201
    notify(a, store, run_id, 1)
    body = {"url": "http://127.0.0.1:9/e", "run_id": run_id, "precision": "bf16",
            "applied_version": 1, "sync_state": "ready"}  # fmt: skip
    reply = a.call("POST", "/v1/engines", json=body)
    assert reply.status_code == 201, reply.text
    return a, b, store, reply.json()["engine_id"]


def test_a_version_notified_on_one_replica_reaches_the_others_fleet_view_at_once(
    start_pair: StartPair,
) -> None:
    a, b, store, engine_id = engine_on_a_pair(start_pair, "woken")

    def target_on_b() -> int | None:
        reply = b.call("GET", f"/v1/engines/{engine_id}")
        return reply.json()["target_version"] if reply.status_code == 200 else None

    wait_until(lambda: target_on_b() == 1, DEADLINE_S, "B to see v1 as the engine's target")
    notify(a, store, "woken", 2)
    wait_until(lambda: target_on_b() == 2, DEADLINE_S, "B to see v2 as the engine's target")


def test_an_engine_deregistered_on_one_replica_leaves_the_others_routes_at_once(
    start_pair: StartPair,
) -> None:
    a, b, _store, engine_id = engine_on_a_pair(start_pair, "leaving")

    def routed_on_b() -> str | None:
        reply = b.call("GET", "/v1/route", params={"run_id": "leaving", "min_version": 1})
        if reply.status_code == 409:
            return None
        assert reply.status_code == 200, reply.text
        return reply.json()["engine_id"]

    wait_until(lambda: routed_on_b() == engine_id, DEADLINE_S, "B to route to the engine")
    assert a.call("DELETE", f"/v1/engines/{engine_id}").status_code == 204
    wait_until(lambda: routed_on_b() is None, DEADLINE_S, "B to stop routing to the engine")
    assert b.call("GET", f"/v1/engines/{engine_id}").status_code == 404


def test_a_database_outage_answers_503_keeps_routing_and_keeps_leases(
    start_pair: StartPair,
    server: PostgresServer,
    tmp_path: Path,
) -> None:
    a, b, store = start_pair(
        {"TETHER_LEASE_SECONDS": str(LEASE_S), "TETHER_TOKEN_CACHE_S": "0.2",
         "TETHER_SNAPSHOT_REFRESH_S": "0.2", "TETHER_DEFAULT_RETRY_AFTER_S": "1"}
    )  # fmt: skip
    assert a.call("POST", "/v1/runs", json={"run_id": "outage"}).status_code == 201
    notify(a, store, "outage", 1)
    tokens = {}
    for role in ("engine", "client"):
        reply = a.call("POST", "/v1/tokens", json={"role": role, "name": f"outage-{role}"})
        assert reply.status_code == 201, reply.text
        tokens[role] = reply.json()["token"]
    standin_port = free_port()
    argv = [sys.executable, "-m", "tests.standins.engine", "--port", str(standin_port),
            "--version", "1", "--controlplane", a.url, "--token", tokens["engine"],
            "--run-id", "outage", "--heartbeat-s", "0.5"]  # fmt: skip
    with ProcessGroup(tmp_path / "standin-logs") as group:
        standin = group.start("standin", argv, url=f"http://127.0.0.1:{standin_port}")
        standin.wait_http("/health", deadline_s=DEADLINE_S)
        body = {"text": "hi", "run_id": "outage", "weight_version": {"min_version": 1}}

        def generate(replica: Replica) -> httpx.Response:
            return replica.call("POST", "/v1/generate", tokens["client"], json=body)

        for replica in (a, b):
            wait_until(
                lambda r=replica: generate(r).status_code == 200, DEADLINE_S, "routing to work"
            )
        engines = a.call("GET", "/v1/engines").json()["engines"]
        assert len(engines) == 1
        engine_id, lease = engines[0]["engine_id"], engines[0]["lease_expires_at"]

        server.stop()
        # Past the lease the engine held when the database went away.
        served: list[int] = []
        wait_until(
            lambda: (
                served.extend(generate(r).status_code for r in (a, b))
                or time.time() > lease + LEASE_S
            ),
            DEADLINE_S,
            "the outage to outlast the engine's lease",
        )
        assert set(served) == {200}, served
        for reply in (
            a.call("GET", "/v1/runs"),
            b.call("POST", "/v1/runs", json={"run_id": "during-outage"}),
            b.call("POST", f"/v1/engines/{engine_id}/heartbeat", tokens["engine"],
                   json={"applied_version": 1, "sync_state": "ready"}),
        ):  # fmt: skip
            assert reply.status_code == 503, reply.text
            assert reply.headers["content-type"].startswith("application/json")
            assert int(reply.headers["retry-after"]) >= 1
            error = reply.json()["error"]
            assert error["type"] == "DatabaseUnavailable" and error["retryable"] is True

        server.start()
        wait_until(
            lambda: a.call("GET", "/v1/engines").status_code == 200,
            DEADLINE_S,
            "the database to answer again",
        )
        wait_until(
            lambda: (
                [e["engine_id"] for e in a.call("GET", "/v1/engines").json()["engines"]]
                == [engine_id]
            ),
            DEADLINE_S,
            "the engine listed under its own id",
        )
        assert all(generate(r).status_code == 200 for r in (a, b))
        # One registration: the lease was renewed on recovery, never lapsed.
        assert standin.log_path.read_text().count("REGISTERED") == 1
    for replica in (a, b):
        log = replica.process.log_path.read_text()
        assert "Traceback" not in log, log[-3000:]
        assert "database unavailable" in log
