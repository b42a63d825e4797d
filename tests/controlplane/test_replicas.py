"""Several control-plane replicas on one PostgreSQL act as one control plane.

Two real `tether controlplane serve` processes share a database (migrated once, before
either starts) and a store folder, with the default refresh and polling settings. Whatever
is written through one replica must be seen, routed, woken and authorised by the other.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launcher.processes import TETHER, ProcessGroup, free_port, wait_until
from tests.controlplane.conftest import ADMIN, publish
from tests.fixtures.postgres import fresh_database

pytestmark = pytest.mark.postgres

LEASE_S = 3.0
ROUTABLE_WITHIN_S = 2.0


@dataclass
class Replica:
    url: str

    def call(self, method: str, path: str, token: str = ADMIN, **kwargs: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=30.0, **kwargs)

    def mint(self, role: str) -> str:
        reply = self.call("POST", "/v1/tokens", json={"role": role, "name": f"replicas-{role}"})
        assert reply.status_code == 201, reply.text
        return reply.json()["token"]


@dataclass
class Pair:
    a: Replica
    b: Replica
    store: Path

    def notify(self, replica: Replica, run_id: str, version: int) -> None:
        publish(self.store, run_id, version)
        reply = replica.call("POST", f"/v1/runs/{run_id}/versions", json={"version": version})
        assert reply.status_code == 201, reply.text

    def register(self, replica: Replica, run_id: str, version: int, precision: str) -> dict:
        body = {
            "url": f"http://127.0.0.1:9/{uuid.uuid4().hex[:6]}",
            "run_id": run_id,
            "precision": precision,
            "applied_version": version,
            "sync_state": "ready",
        }
        reply = replica.call("POST", "/v1/engines", json=body)
        assert reply.status_code == 201, reply.text
        return reply.json()


@pytest.fixture(scope="module")
def pair(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Replicas A and B of one control plane: one database, one store, two processes."""
    root = tmp_path_factory.mktemp("replicas")
    store = root / "store"
    store.mkdir()
    db = fresh_database(postgres_url, f"replicas_{uuid.uuid4().hex[:12]}")
    migrated = subprocess.run(
        [TETHER, "controlplane", "migrate", "--db", db], capture_output=True, text=True
    )
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    env = {"TETHER_ADMIN_TOKEN": ADMIN, "TETHER_LEASE_SECONDS": str(LEASE_S)}
    with ProcessGroup(root / "logs") as group:
        replicas = []
        for name in ("a", "b"):
            port = free_port()
            argv = [TETHER, "controlplane", "serve", "--db", db, "--store", str(store),
                    "--port", str(port), "--no-migrate", "--log-level", "warning"]  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            replicas.append(group.start(f"replica-{name}", argv, env=env, url=url))
        for replica in replicas:
            replica.wait_http("/readyz", deadline_s=60.0)
        yield Pair(Replica(replicas[0].url or ""), Replica(replicas[1].url or ""), store)


def test_runs_and_engines_registered_on_one_replica_are_routable_through_another(
    pair: Pair,
) -> None:
    assert pair.a.call("POST", "/v1/runs", json={"run_id": "shared-fleet"}).status_code == 201
    pair.notify(pair.a, "shared-fleet", 1)
    engines = {p: pair.register(pair.a, "shared-fleet", 1, p)["engine_id"] for p in ("bf16", "fp8")}

    def routed_by_b() -> dict[str, str] | None:
        found = {}
        for precision in engines:
            reply = pair.b.call(
                "GET", "/v1/route",
                params={"run_id": "shared-fleet", "min_version": 1, "precision": precision},
            )  # fmt: skip
            if reply.status_code != 200:
                return None
            found[precision] = reply.json()["engine_id"]
        return found

    # The deadline is the bound: wait_until fails the test once it passes.
    routed = wait_until(routed_by_b, ROUTABLE_WITHIN_S, "replica B to route to A's engines")
    assert routed == engines
    assert pair.b.call("GET", "/v1/runs/shared-fleet").json()["latest_version"] == 1


def test_a_version_notified_on_one_replica_wakes_a_long_poll_held_on_another(pair: Pair) -> None:
    assert pair.a.call("POST", "/v1/runs", json={"run_id": "shared-wake"}).status_code == 201
    pair.notify(pair.a, "shared-wake", 1)
    sent = threading.Event()
    answer: dict[str, object] = {}

    def hold_long_poll() -> None:
        with httpx.Client(event_hooks={"request": [lambda _request: sent.set()]}) as client:
            reply = client.get(
                pair.b.url + "/v1/runs/shared-wake/versions/wait",
                params={"after": 1, "timeout": 30},
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=40.0,
            )
        answer["at"] = time.monotonic()
        answer["versions"] = [v["version"] for v in reply.json()["versions"]]

    waiter = threading.Thread(target=hold_long_poll)
    waiter.start()
    assert sent.wait(10), "the long-poll request was never sent"
    notified_at = time.monotonic()
    pair.notify(pair.a, "shared-wake", 2)
    waiter.join(35)
    assert not waiter.is_alive(), "the long-poll on B was not answered"
    assert answer["versions"] == [2]
    # Woken by the version, not by the 30 s timeout.
    assert float(answer["at"]) - notified_at < 5.0  # type: ignore[arg-type]


def test_a_heartbeat_on_one_replica_renews_a_lease_registered_on_another(pair: Pair) -> None:
    assert pair.a.call("POST", "/v1/runs", json={"run_id": "shared-lease"}).status_code == 201
    pair.notify(pair.a, "shared-lease", 1)
    engine_id = pair.register(pair.a, "shared-lease", 1, "bf16")["engine_id"]
    first_expiry = pair.a.call("GET", f"/v1/engines/{engine_id}").json()["lease_expires_at"]

    def heartbeat_on_b() -> float:
        beat = pair.b.call(
            "POST", f"/v1/engines/{engine_id}/heartbeat",
            json={"applied_version": 1, "sync_state": "ready"},
        )  # fmt: skip
        assert beat.status_code == 200, beat.text
        return beat.json()["lease_expires_at"]

    renewed = heartbeat_on_b()
    assert renewed > first_expiry
    # B may answer a beat before its commit (its snapshot shows the lease): the renewal
    # is then in the database a moment later, and at least as long as B said.
    wait_until(
        lambda: (
            pair.a.call("GET", f"/v1/engines/{engine_id}").json()["lease_expires_at"] >= renewed
        ),
        LEASE_S,
        "the renewal made on B to be read on A",
    )
    # Keep beating on B only, at the agent's pace, until A's original lease has long lapsed.
    wait_until(
        lambda: heartbeat_on_b() and time.time() > first_expiry + 1.0,
        LEASE_S + 5.0,
        "the lease registered on A to outlive its first expiry",
        interval_s=0.5,
    )
    route = pair.a.call("GET", "/v1/route", params={"run_id": "shared-lease", "min_version": 1})
    assert route.status_code == 200, route.text
    assert route.json()["engine_id"] == engine_id


def test_a_token_minted_on_one_replica_is_accepted_by_another_with_its_role(
    pair: Pair,
) -> None:
    client_token = pair.a.mint("client")
    trainer_token = pair.a.mint("trainer")
    assert pair.b.call("GET", "/v1/runs", client_token).status_code == 200
    created = pair.b.call("POST", "/v1/runs", trainer_token, json={"run_id": "shared-auth"})
    assert created.status_code == 201, created.text
    # The role travels with the token: a client may not create runs on B either.
    refused = pair.b.call("POST", "/v1/runs", client_token, json={"run_id": "shared-auth-2"})
    assert refused.status_code == 403, refused.text
    unknown = pair.b.call("GET", "/v1/runs", "tth_" + "0" * 32)
    assert unknown.status_code == 401, unknown.text
