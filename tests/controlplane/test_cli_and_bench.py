"""The command line (`tether token create`, `tether controlplane migrate`) and a tiny bench."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, inspect

from launcher.processes import ManagedProcess, free_port, start_process
from tests.controlplane.conftest import ROOT, TETHER


def _tether(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TETHER, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )


def test_migrate_creates_the_schema_and_token_create_mints_a_hashed_token(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    migrated = _tether("controlplane", "migrate", "--db", db)
    assert migrated.returncode == 0, migrated.stderr
    assert {"runs", "versions", "engines", "tokens", "pins"} <= set(
        inspect(create_engine(db)).get_table_names()
    )
    minted = _tether("token", "create", "--role", "trainer", "--name", "ci", "--db", db)
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.split()[-1]
    assert token.startswith("tth_")
    stored = (tmp_path / "cli.db").read_bytes()
    assert token.encode() not in stored, "only the hash is stored"


def test_token_create_without_db_writes_where_serve_without_db_reads_and_prints_only_it(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TETHER_DB_URL", "TETHER_STORE")}

    def here(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [TETHER, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
        )

    assert here("controlplane", "migrate").returncode == 0
    minted = here("token", "create", "--role", "client")
    assert minted.returncode == 0, minted.stderr
    assert re.fullmatch(r"tth_[A-Za-z0-9_-]+\n", minted.stdout), "stdout is the token alone"
    assert "stored in" in minted.stderr
    token = minted.stdout.strip()

    port = free_port()
    server = start_process(
        "controlplane",
        [TETHER, "controlplane", "serve", "--port", str(port), "--log-level", "warning"],
        tmp_path / "cp.log",
        url=f"http://127.0.0.1:{port}",
        cwd=tmp_path,
    )
    processes.append(server)
    server.wait_http("/readyz", 30)
    reply = httpx.get(server.url + "/v1/runs", headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200, "the server reads the database the token went into"


def test_token_create_refuses_an_unknown_role_without_a_traceback(tmp_path: Path) -> None:
    result = _tether("token", "create", "--role", "root", "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert result.returncode == 2
    assert "unknown role" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_router_bench_runs_at_a_tiny_size_and_ends_with_its_json_figures() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.router", "--samples", "40", "--requests", "40",
         "--concurrency", "4",
         "--fleet", "20", "--heartbeat-seconds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in (
        "router_p50_added_ms",
        "router_p99_added_ms",
        "router_rps_over_rust",
        "route_decision_us_1000",
        "heartbeat_p99_ms_sqlite",
        "heartbeat_p99_ms_postgres",
        "direct_client_rps",
        "direct_client_rps_over_rust",
        "direct_client_route_lookups",
    ):
        assert key in figures  # fmt: skip
    assert figures["router_rps"] > 0
    # The direct client served its requests and asked the control plane for candidates (how
    # often depends on the machine's speed against the set's 1 s validity, so only >= 1).
    assert figures["direct_client_rps"] > 0
    assert figures["direct_client_route_lookups"] >= 1
    assert figures["heartbeat_p99_ms_sqlite"] > 0
