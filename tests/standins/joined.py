"""Stand-in engines that join a local control plane's fleet, and the short version chain
the trainer-client tests route against (v1..v3 of one 8×8 tensor)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from demo.local_fleet import LocalControlPlane
from launcher.processes import ManagedProcess, ProcessGroup, free_port
from trainer_client.publisher import Publisher

ROOT = Path(__file__).resolve().parents[2]


def publish_chain(store: str, run_id: str, cp: LocalControlPlane, versions: int = 3) -> Publisher:
    """Claim `run_id` and publish v1..`versions` (v's one changed value is v itself)."""
    publisher = Publisher(store, run_id, cp.url, cp.tokens["trainer"], progress=False)
    weights = {"w": torch.zeros(8, 8)}
    publisher.claim(0, weights)
    for version in range(1, versions + 1):
        weights["w"][0, 0] = float(version)
        publisher.publish(weights)
    return publisher


def start_joined(
    group: ProcessGroup,
    name: str,
    cp: LocalControlPlane,
    run_id: str,
    *,
    version: int,
    precision: str = "bf16",
    heartbeat_s: float = 0.2,
    extra: tuple[str, ...] = (),
) -> ManagedProcess:
    """A stand-in engine serving `version` that registers with `cp` and heartbeats."""
    port = free_port()
    return group.start(
        name,
        [sys.executable, "-m", "tests.standins.engine", "--port", str(port),
         "--version", str(version), "--precision", precision,
         "--controlplane", cp.url, "--token", cp.tokens["engine"], "--run-id", run_id,
         "--heartbeat-s", str(heartbeat_s), *extra],
        url=f"http://127.0.0.1:{port}",
        cwd=ROOT,
    )  # fmt: skip
