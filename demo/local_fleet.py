"""The demo's services: a control plane, engines (reference, or vLLM for `bf16:vllm` in
`--engines`) and one agent per engine.

Owns the order things come up in and how they are wired: the tiny model and its FP8/NVFP4
conversions, the control plane (SQLite under the work dir unless `--db` says otherwise)
with one token per role, then each engine booted from its precision's checkpoint and its
agent following the run. Every process belongs to the caller's `ProcessGroup`, which stops
them. It never trains and never publishes.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from demo.settings import DemoSettings
from launcher.processes import TETHER, ManagedProcess, ProcessFailed, ProcessGroup, free_port

log = logging.getLogger(__name__)

ROLES = ("trainer", "engine", "client", "viewer")


def prepare_models(root: Path, precisions: set[str], seed: int) -> dict[str, Path]:
    """The tiny BF16 model (seed `seed`) and its conversions, one folder per precision.

    Folders that already hold a checkpoint are reused (same spec, same bytes)."""
    from engine_agent.precision import convert_checkpoint
    from reference_engine.tiny_model import TinyModelSpec, init_tiny_model

    folders = {"bf16": root / f"tiny-seed{seed}-bf16"}
    if not (folders["bf16"] / "config.json").is_file():
        init_tiny_model(folders["bf16"], TinyModelSpec(seed=seed))
    for precision in sorted(precisions - {"bf16"}):
        folders[precision] = root / f"tiny-seed{seed}-{precision}"
        if not (folders[precision] / "config.json").is_file():
            convert_checkpoint(folders["bf16"], precision, folders[precision])
    return folders


@dataclass
class LocalControlPlane:
    """A running control plane and a token for each role."""

    url: str
    process: ManagedProcess
    tokens: dict[str, str] = field(default_factory=dict)

    def get(self, path: str, role: str = "client", **params: Any) -> Any:
        response = httpx.get(
            self.url + path,
            params=params or None,
            headers={"Authorization": f"Bearer {self.tokens[role]}"},
            timeout=10.0,
        )
        response.raise_for_status()
        return response.json()

    def engines(self, run_id: str) -> list[dict[str, Any]]:
        return self.get("/v1/engines", run_id=run_id)["engines"]


@dataclass
class EngineWithAgent:
    """One reference engine and the agent in front of it."""

    precision: str
    engine: ManagedProcess
    agent: ManagedProcess

    def server_info(self) -> dict[str, Any] | None:
        try:
            response = httpx.get(f"{self.agent.url}/server_info", timeout=5.0)
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None


def start_controlplane(
    group: ProcessGroup, db_url: str, store_url: str, env: Mapping[str, str] | None = None
) -> LocalControlPlane:
    """`tether controlplane serve` with fast snapshots, then one token per role.

    `env` overrides the control plane's settings (e.g. shorter leases for tests)."""
    admin = "tth_demo-" + secrets.token_hex(16)
    port = free_port()
    env = {
        "TETHER_ADMIN_TOKEN": admin,
        "TETHER_LEASE_SECONDS": "10",
        "TETHER_HEARTBEAT_INTERVAL_S": "0.5",
        "TETHER_SNAPSHOT_REFRESH_S": "0.1",
        "TETHER_POLL_INTERVAL_S": "0.05",
        "TETHER_DEFAULT_RETRY_AFTER_S": "0.2",
        **(env or {}),
    }
    process = group.start(
        "controlplane",
        [TETHER, "controlplane", "serve", "--db", db_url, "--store", store_url,
         "--port", str(port), "--log-level", "warning"],
        env=env,
        url=f"http://127.0.0.1:{port}",
        serves_others=True,  # agents deregister with it on their way out
    )  # fmt: skip
    process.wait_http("/readyz", deadline_s=60.0)
    cp = LocalControlPlane(process.url or "", process, {"admin": admin})
    for role in ROLES:
        response = httpx.post(
            cp.url + "/v1/tokens",
            json={"role": role, "name": f"demo-{role}"},
            headers={"Authorization": f"Bearer {admin}"},
            timeout=10.0,
        )
        if response.status_code != 201:
            raise ProcessFailed(f"could not mint a {role} token: {response.text}")
        cp.tokens[role] = response.json()["token"]
    return cp


def start_engines(
    group: ProcessGroup,
    settings: DemoSettings,
    models: dict[str, Path],
    cp: LocalControlPlane,
    run_id: str,
    store_url: str,
    workdir: Path,
) -> list[EngineWithAgent]:
    """Start every engine, then its agent; return once every agent serves the boot version."""
    started: list[tuple[str, str, ManagedProcess]] = []
    for index in range(settings.engines):
        precision, kind = settings.precision_of(index), settings.kind_of(index)
        port = free_port()
        if kind == "vllm":
            argv = [TETHER, "engine", "vllm", "--model", str(models[precision]),
                    "--port", str(port), "--threads", "1"]  # fmt: skip
        else:
            argv = [TETHER, "engine", "reference", "--model", str(models[precision]),
                    "--port", str(port), "--weight-version", "0", "--threads", "1",
                    "--log-level", "warning"]  # fmt: skip
        engine = group.start(
            f"engine-{index}-{precision}-{kind}",
            argv,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
            url=f"http://127.0.0.1:{port}",
        )
        started.append((precision, kind, engine))
    fleet: list[EngineWithAgent] = []
    for index, (precision, kind, engine) in enumerate(started):
        if kind == "vllm":
            # vLLM starts in 20-50 s alone, minutes on a busy small machine.
            engine.wait_http("/health", deadline_s=max(settings.start_deadline_s, 600.0))
        else:
            engine.wait_http("/ready", deadline_s=settings.start_deadline_s)
        port = free_port()
        agent = group.start(
            f"agent-{index}-{precision}",
            [TETHER, "agent", "run", "--engine-url", engine.url or "",
             "--engine-kind", "vllm" if kind == "vllm" else "sglang",
             "--precision", precision, "--control-plane", cp.url, "--store", store_url,
             "--run", run_id, "--port", str(port), "--boot-model", str(models[precision]),
             "--boot-version", "0", "--work-dir", str(workdir / f"agent-{index}-{precision}"),
             "--capacity", "8", "--label", "engine=reference", "--log-level", "warning"],
            env={
                "TETHER_TOKEN": cp.tokens["engine"],
                "TETHER_AGENT_POINTER_POLL_S": "0.2",
                "TETHER_AGENT_RETRY_INITIAL_S": "0.2",
                "TETHER_AGENT_RETRY_MAX_S": "2",
                "OMP_NUM_THREADS": "1",
            },
            url=f"http://127.0.0.1:{port}",
        )  # fmt: skip
        fleet.append(EngineWithAgent(precision, engine, agent))
    for member in fleet:
        member.agent.wait_http("/health", deadline_s=settings.start_deadline_s)
    return fleet
