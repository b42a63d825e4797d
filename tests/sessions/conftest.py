"""A real fleet for agent-session tests: a control plane on PostgreSQL, a folder store
holding the tiny model's v0, two BF16 reference engines with an engine agent beside each,
all processes on 127.0.0.1.

Module-scoped (starting processes is the expensive part); tests create their own sessions
and leave the fleet serving. `SessionFleet.restart_controlplane()` stops the control plane
and starts it again on the same port and database.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.controlplane.conftest import ADMIN, start_controlplane
from tests.engine_agent.conftest import (
    ControlPlaneProcess,
    VersionChain,
    launch_agent,
    wait_agent,
    wait_applied,
)
from tests.fixtures.postgres import fresh_database, postgres_url  # noqa: F401
from tests.fixtures.processes import ManagedProcess, stop_all, wait_until
from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    launch_reference_engine,
    wait_until_ready,
)

RUN = "sessions-run"
CP_ENV = {
    "TETHER_LEASE_SECONDS": "5",
    "TETHER_HEARTBEAT_INTERVAL_S": "0.5",
    "TETHER_SNAPSHOT_REFRESH_S": "0.1",
    "TETHER_POLL_INTERVAL_S": "0.05",
    "TETHER_TOKEN_CACHE_S": "0",
    "TETHER_DEFAULT_RETRY_AFTER_S": "0.2",
}
ROLES = ("trainer", "engine", "client", "viewer")
# Waits end as soon as their event happens; the bound only has to survive a busy machine
# (catching up to a new version on two cores under load has taken over a minute).
DEADLINE_S = 180.0


@dataclass
class SessionFleet:
    root: Path
    db_url: str
    chain: VersionChain
    cp: ControlPlaneProcess
    engines: list[ReferenceEngineProcess]
    agents: list[ManagedProcess]
    model: Path
    extra: list[ManagedProcess] = field(default_factory=list)

    def call(self, method: str, path: str, role: str = "client", **kwargs: Any) -> httpx.Response:
        return self.cp.call(method, path, role, **kwargs)

    def create(self, role: str = "client", **body: Any) -> dict[str, Any]:
        reply = self.call("POST", "/v1/sessions", role, json={"run_id": RUN, **body})
        assert reply.status_code == 201, reply.text
        return reply.json()

    def turn(self, session_id: str, messages: list[dict], **body: Any) -> httpx.Response:
        payload = {"model": "tiny", "messages": messages, "max_tokens": 8, **body}
        return self.call("POST", f"/v1/sessions/{session_id}/chat/completions", json=payload)

    def chat(self, session_id: str, messages: list[dict], **body: Any) -> dict[str, Any]:
        """A turn that must succeed: retried only while no engine is ready (409/503)."""

        def attempt() -> dict[str, Any] | None:
            reply = self.turn(session_id, messages, **body)
            if reply.status_code in (409, 503) and reply.json()["error"]["retryable"]:
                return None
            assert reply.status_code == 200, reply.text
            return reply.json()

        return wait_until(attempt, DEADLINE_S, f"a turn of {session_id}")

    def trajectory(self, session_id: str) -> dict[str, Any]:
        reply = self.call("GET", f"/v1/sessions/{session_id}/trajectory")
        assert reply.status_code == 200, reply.text
        return reply.json()

    def engine_ids(self) -> dict[str, str]:
        """Agent URL → engine id, as the control plane has them."""
        return {e["url"]: e["engine_id"] for e in self.cp.engines(RUN)}

    def wait_engines(self, count: int, version: int | None = None) -> None:
        def ready() -> bool:
            engines = self.cp.engines(RUN)
            serving = [
                e
                for e in engines
                if e["sync_state"] == "ready"
                and (version is None or e["applied_version"] == version)
            ]
            return len(serving) >= count

        wait_until(ready, DEADLINE_S, f"{count} serving engines")

    def restart_controlplane(self) -> None:
        port = int(self.cp.url.rsplit(":", 1)[1])
        self.cp.process.stop()
        process = start_controlplane(
            self.db_url, self.chain.store_root, self.root / "cp-2.log", port, **CP_ENV
        )
        self.extra.append(process)
        self.cp = ControlPlaneProcess(process, self.cp.url, self.cp.tokens)


@pytest.fixture(scope="module")
def fleet(
    tiny: TinyCheckpoints,
    tmp_path_factory: pytest.TempPathFactory,
    postgres_url: str,  # noqa: F811
) -> Iterator[SessionFleet]:
    root = tmp_path_factory.mktemp("sessions")
    db_url = fresh_database(postgres_url, f"s_{uuid.uuid4().hex[:12]}")
    engines = [launch_reference_engine(tiny.bf16, root / f"engine-{i}.log") for i in range(2)]
    chain = VersionChain(root / "store", RUN, tiny.bf16)
    process = start_controlplane(db_url, chain.store_root, root / "cp.log", **CP_ENV)
    agents: list[ManagedProcess] = []
    fleet: SessionFleet | None = None
    try:
        cp = ControlPlaneProcess(process, process.url or "", {"admin": ADMIN})
        for role in ROLES:
            reply = cp.call("POST", "/v1/tokens", json={"role": role, "name": f"sessions-{role}"})
            assert reply.status_code == 201, reply.text
            cp.tokens[role] = reply.json()["token"]
        body = {"run_id": RUN, "base_checkpoint": str(tiny.bf16)}
        reply = cp.call("POST", "/v1/runs", "trainer", json=body)
        assert reply.status_code == 201, reply.text
        cp.notify(RUN, 0)
        for i, engine in enumerate(engines):
            agents.append(
                launch_agent(
                    f"agent-{i}", engine.url or "", "bf16", root,
                    store_root=chain.store_root, run_id=RUN, boot_model=tiny.bf16,
                    control_plane=cp,
                )
            )  # fmt: skip
        for engine in engines:
            wait_until_ready(engine)
        for agent in agents:
            wait_agent(agent)
            wait_applied(agent, 0, DEADLINE_S)
        fleet = SessionFleet(root, db_url, chain, cp, engines, agents, tiny.bf16)
        fleet.wait_engines(2)
        yield fleet
    finally:
        extra = fleet.extra if fleet is not None else []
        # Stopped agents linger after their clean shutdown; a short grace is plenty here.
        stop_all([*agents, *engines, *extra, process], grace_s=3.0)
