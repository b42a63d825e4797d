"""Fixtures of the control-plane tests: real databases, real servers, real engine stand-ins.

`api` is the application in process (Starlette's TestClient runs its lifespan and its
refresher) on a fresh SQLite file, or on PostgreSQL for tests that ask for `db_url`
parametrised. `server` starts `tether controlplane serve` as a process; `standins` start
engine stand-in processes. Everything listens on 127.0.0.1 with random free ports.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from launcher.processes import ManagedProcess, ProcessFailed, free_port, start_process, wait_until
from tests.fixtures.postgres import fresh_database, postgres_url  # noqa: F401

ADMIN = "tth_test-admin-token-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]
TETHER = str(Path(sys.executable).with_name("tether"))
START_DEADLINE_S = 30.0


def publish(store_root: Path, run_id: str, version: int) -> None:
    """Lay out a version and move the pointer the way the store does (file:// layout)."""
    name = f"weight_v{version:06d}"
    folder = store_root / run_id / "updates" / name
    folder.mkdir(parents=True, exist_ok=True)
    index = {"metadata": {"version": f"{version:06d}"}, "weight_map": {}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (store_root / run_id / "latest").write_text(f"{run_id}/{name}")


@dataclass
class Api:
    """A client of one control plane with a token per role."""

    client: Any
    store_root: Path
    tokens: dict[str, str] = field(default_factory=dict)

    def auth(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def call(self, method: str, path: str, role: str = "admin", **kwargs: Any) -> Any:
        headers = {**self.auth(role), **kwargs.pop("headers", {})}
        return self.client.request(method, path, headers=headers, **kwargs)

    def mint_roles(self) -> None:
        self.tokens["admin"] = ADMIN
        for role in ("trainer", "engine", "client", "viewer"):
            reply = self.call("POST", "/v1/tokens", json={"role": role, "name": f"test-{role}"})
            assert reply.status_code == 201, reply.text
            self.tokens[role] = reply.json()["token"]

    def create_run(self, run_id: str, **extra: Any) -> dict[str, Any]:
        reply = self.call("POST", "/v1/runs", "trainer", json={"run_id": run_id, **extra})
        assert reply.status_code == 201, reply.text
        return reply.json()

    def publish(self, run_id: str, version: int) -> dict[str, Any]:
        publish(self.store_root, run_id, version)
        reply = self.call(
            "POST", f"/v1/runs/{run_id}/versions", "trainer", json={"version": version}
        )
        assert reply.status_code == 201, reply.text
        return reply.json()

    def register(self, run_id: str, version: int | None, **extra: Any) -> str:
        body = {
            "url": extra.pop("url", f"http://127.0.0.1:9/{uuid.uuid4().hex[:6]}"),
            "run_id": run_id,
            "precision": extra.pop("precision", "bf16"),
            "applied_version": version,
            "sync_state": extra.pop("sync_state", "ready"),
            **extra,
        }
        reply = self.call("POST", "/v1/engines", "engine", json=body)
        assert reply.status_code == 201, reply.text
        return reply.json()["engine_id"]

    def heartbeat(self, engine_id: str, version: int | None, **extra: Any) -> Any:
        body = {"applied_version": version, "sync_state": extra.pop("sync_state", "ready"), **extra}
        return self.call("POST", f"/v1/engines/{engine_id}/heartbeat", "engine", json=body)

    def target_while_publishing(self, run_id: str, engine_id: str, after: int) -> Any:
        """The reply of the engine's target long-poll (`after` its known target), while
        version `after + 1` is published."""
        result: dict[str, Any] = {}

        def waiter() -> None:
            path = f"/v1/engines/{engine_id}/target?after={after}&timeout=20"
            result.update(self.call("GET", path, "engine").json())

        thread = threading.Thread(target=waiter)
        thread.start()
        self.publish(run_id, after + 1)
        thread.join(20)
        return result

    def settle(self) -> None:
        """Wait until the app's fleet snapshot reflects every write made so far."""
        app = self.client.app
        mark = time.time()
        wait_until(lambda: app.state.cp.fleet.snapshot.read_at > mark, 5.0, "a fresh snapshot")


def make_settings(db_url: str, store_root: Path, **overrides: Any) -> Any:
    from controlplane.settings import ControlPlaneSettings

    values: dict[str, Any] = {
        "db_url": db_url,
        "store": str(store_root),
        "admin_token": ADMIN,
        "snapshot_refresh_s": 0.1,
        "poll_interval_s": 0.05,
        "token_cache_s": 0.0,
    }
    values.update(overrides)
    return ControlPlaneSettings(**values)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cp.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'cp.db'}"
    server = request.getfixturevalue("postgres_url")
    return fresh_database(server, f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def make_api(tmp_path: Path) -> Iterator[Callable[..., Api]]:
    from starlette.testclient import TestClient

    from controlplane.app import create_app
    from controlplane.db import migrate

    opened: list[Any] = []

    def build(db_url: str, **overrides: Any) -> Api:
        store_root = tmp_path / "store"
        store_root.mkdir(exist_ok=True)
        migrate(db_url)
        client = TestClient(create_app(make_settings(db_url, store_root, **overrides)))
        client.__enter__()
        opened.append(client)
        api = Api(client, store_root)
        api.mint_roles()
        return api

    yield build
    for client in reversed(opened):
        client.__exit__(None, None, None)


@pytest.fixture
def api(make_api: Callable[..., Api], sqlite_url: str) -> Api:
    return make_api(sqlite_url)


def _spawn(
    name: str,
    argv: list[str],
    log: Path,
    ready_path: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> ManagedProcess:
    """Start `argv` (with `{port}` filled in: `port`, else a free one) and wait until
    `ready_path` answers 200.

    A free port can be taken by another process between choosing and binding; then the
    start is tried again on a new port (never when `port` was given).
    """
    for _attempt in range(1 if port is not None else 3):
        chosen = port or free_port()
        process = start_process(
            name,
            [a.replace("{port}", str(chosen)) for a in argv],
            log,
            env=env,
            url=f"http://127.0.0.1:{chosen}",
            cwd=ROOT,
        )
        try:
            return process.wait_http(ready_path, START_DEADLINE_S)
        except ProcessFailed:
            if "address already in use" not in log.read_text():
                raise
    raise AssertionError(f"could not find a free port for {argv[0]}")


def start_controlplane(
    db_url: str, store_root: Path, log: Path, port: int | None = None, **env: str
) -> ManagedProcess:
    """`tether controlplane serve` on `port` (default: a free one); `env` sets TETHER_*."""
    argv = [TETHER, "controlplane", "serve", "--db", db_url, "--store", str(store_root),
            "--port", "{port}", "--log-level", "warning"]  # fmt: skip
    env = {"TETHER_ADMIN_TOKEN": ADMIN, **env}
    return _spawn("controlplane", argv, log, "/readyz", env, port)


def start_standin(version: int, log: Path, *args: str) -> ManagedProcess:
    argv = [sys.executable, "-m", "tests.standins.engine", "--port", "{port}",
            "--version", str(version), *args]  # fmt: skip
    return _spawn("standin", argv, log, "/health")


@pytest.fixture
def processes() -> Iterator[list[ManagedProcess]]:
    """Processes started by a test; all stopped at teardown, newest first."""
    started: list[ManagedProcess] = []
    yield started
    for proc in reversed(started):
        proc.stop()
