"""An engine agent survives what goes wrong around it, shown on real processes: a staging
disk that fills up, an engine that restarts, a control plane that forgets the engine, and
control planes that stop answering; and once booted, its codecs are warm and its cycle
collector leaves the imports alone.

Each test starts its own reference engine (BF16), folder store and agent, and, where the
test needs one, its own control plane on SQLite.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine_agent.conftest import (
    ControlPlaneProcess,
    VersionChain,
    generate,
    launch_agent,
    server_info,
    start_controlplane,
    wait_agent,
    wait_applied,
)
from tests.fixtures.processes import ManagedProcess, free_port, metric, stop_all, wait_until
from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    launch_reference_engine,
    start_reference_engine,
    wait_until_ready,
)

RUN = "resilience-run"
DEADLINE_S = 90.0
PROMPT = {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 2}}


@dataclass
class Setup:
    root: Path
    chain: VersionChain
    engine: ReferenceEngineProcess
    started: list[ManagedProcess]

    def cp(self, env: dict[str, str] | None = None) -> ControlPlaneProcess:
        cp = start_controlplane(self.root, env)
        self.started.append(cp.process)
        reply = cp.call("POST", "/v1/runs", "trainer", json={"run_id": RUN})
        assert reply.status_code == 201, reply.text
        cp.notify(RUN, self.chain.latest)
        return cp

    def agent(self, tiny: TinyCheckpoints, name: str = "agent", **kwargs) -> ManagedProcess:
        agent = launch_agent(
            name, self.engine.url, "bf16", self.root, store_root=self.chain.store_root,
            run_id=RUN, boot_model=tiny.bf16, **kwargs,
        )  # fmt: skip
        self.started.append(agent)
        return wait_agent(agent)


@pytest.fixture
def setup(tiny: TinyCheckpoints, tmp_path: Path) -> Iterator[Setup]:
    engine = start_reference_engine(tiny.bf16, tmp_path / "engine.log")
    found = Setup(tmp_path, VersionChain(tmp_path / "store", RUN, tiny.bf16), engine, [])
    yield found
    stop_all([*found.started, found.engine])


def registered(cp: ControlPlaneProcess, agent: ManagedProcess) -> dict | None:
    return cp.engine(RUN, agent.url or "")


def alive_info(agent: ManagedProcess) -> dict:
    if not agent.alive():
        raise AssertionError(f"{agent.name} exited:\n{agent.log_tail()}")
    return server_info(agent)


def test_a_booted_agent_warms_its_codecs_freezes_what_it_booted_with_and_exports_both(
    setup: Setup, tiny: TinyCheckpoints
) -> None:
    settled = setup.agent(tiny)
    default = setup.agent(
        tiny,
        env_overrides={"TETHER_AGENT_GC_SETTLE": "0", "TETHER_AGENT_WARM_CODECS": "0"},
        name="default",
    )
    # Warmed before serving (what that leaves the first fold is tests/store/test_codec_warm);
    # off, the first catch-up pays it.
    assert metric(settled.url or "", "tether_agent_codecs_warm_seconds") > 0
    assert metric(default.url or "", "tether_agent_codecs_warm_seconds") == 0
    # A BF16 engine's agent converts nothing (the FP8 and NVFP4 ones: test_agent_fleet).
    assert metric(settled.url or "", "tether_agent_conversion_warm_seconds") == 0
    # Settled: one full collection before the freeze (observed), then torch's and
    # transformers' imports are out of every later collection's scan.
    assert metric(settled.url or "", "tether_agent_gc_pause_seconds_count") >= 1
    assert metric(settled.url or "", "tether_agent_gc_pause_seconds_sum") > 0
    assert metric(settled.url or "", "tether_agent_gc_frozen_objects") > 100_000
    # Off: CPython's collector as it was, nothing frozen; pauses are still exported.
    assert metric(default.url or "", "tether_agent_gc_frozen_objects") == 0
    assert "tether_agent_gc_pause_seconds_bucket" in httpx.get(f"{default.url}/metrics").text
    for agent in (settled, default):
        assert generate(agent.url or "", PROMPT).status_code == 200


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (smaller than one staged tiny checkpoint), unmounted after."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_staging_disk_keeps_the_old_version_serving_and_is_retried(
    setup: Setup, tiny: TinyCheckpoints, small_disk: Path
) -> None:
    cp = setup.cp()
    agent = setup.agent(tiny, control_plane=cp, work_dir=small_disk)
    wait_applied(agent, 0, DEADLINE_S)
    version = setup.chain.publish("full")
    cp.notify(RUN, version)

    # The stage does not fit: the pass fails, is counted and reported, and is retried.
    info = wait_until(
        lambda: (i := alive_info(agent))["reconcile_failures"].get("StageFailed", 0) >= 2 and i,
        DEADLINE_S,
        "the agent to fail staging twice",
    )
    assert "No space left" in info["last_error"] or "StorageFull" in info["last_error"]
    assert info["applied_version"] == 0 and info["sync_state"] == "ready"
    entry = wait_until(
        lambda: (e := registered(cp, agent)) and e["last_error"] and e,
        DEADLINE_S,
        "the heartbeat to carry the staging error",
    )
    assert entry["sync_state"] == "ready" and entry["applied_version"] == 0
    assert httpx.get(f"{agent.url}/health").status_code == 200
    assert generate(agent.url or "", PROMPT).status_code == 200
    metrics = httpx.get(f"{agent.url}/metrics").text
    assert 'tether_agent_reconcile_failures_total{error="StageFailed"}' in metrics

    # Room again (the filesystem grows): the next retry commits, nothing half-written stays.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    info = wait_applied(agent, version, DEADLINE_S)
    assert info["last_error"] is None and info["sync_state"] == "ready"
    assert not list((small_disk / "staged").glob(".writing-*"))
    assert agent.alive()


def test_an_agent_recovers_when_its_engine_restarts(setup: Setup, tiny: TinyCheckpoints) -> None:
    cp = setup.cp()
    agent = setup.agent(tiny, control_plane=cp)
    version = setup.chain.publish("full")
    cp.notify(RUN, version)
    wait_applied(agent, version, DEADLINE_S)

    port = int((setup.engine.url or "").rsplit(":", 1)[1])
    setup.engine.process.kill()
    setup.engine.process.wait(10)
    wait_until(
        lambda: (e := registered(cp, agent)) and e["sync_state"] == "error",
        DEADLINE_S,
        "the agent to report its engine gone",
    )
    assert httpx.get(f"{agent.url}/health").status_code == 503

    # The engine comes back on its boot weights (label 0); the agent commits the target again.
    setup.engine = launch_reference_engine(tiny.bf16, setup.root / "engine-2.log", port=port)
    wait_until_ready(setup.engine)
    info = wait_until(
        lambda: (
            (i := alive_info(agent))["sync_state"] == "ready"
            and i["applied_version"] == version
            and i
        ),
        DEADLINE_S,
        "the agent to serve the target again after the engine restarted",
    )
    assert info["last_error"] is None
    assert httpx.get(f"{agent.url}/health").status_code == 200
    assert generate(agent.url or "", PROMPT).status_code == 200
    entry = wait_until(
        lambda: (e := registered(cp, agent)) and e["sync_state"] == "ready" and e,
        DEADLINE_S,
        "the control plane to see the agent ready again",
    )
    assert entry["applied_version"] == version
    with setup.engine.client() as engine:
        assert engine.get("/model_info").json()["weight_version"] == str(version)


def test_a_target_poll_answered_404_registers_again_at_once(
    setup: Setup, tiny: TinyCheckpoints
) -> None:
    # Heartbeats are an hour apart here: only the target poll can notice the 404 in time.
    cp = setup.cp({"TETHER_HEARTBEAT_INTERVAL_S": "3600", "TETHER_LEASE_SECONDS": "7200"})
    agent = setup.agent(tiny, control_plane=cp, env_overrides={"TETHER_AGENT_LONG_POLL_S": "0.5"})
    first = wait_until(lambda: registered(cp, agent), DEADLINE_S, "the agent to register")
    reply = cp.call("DELETE", f"/v1/engines/{first['engine_id']}", "engine")
    assert reply.status_code == 204, reply.text
    again = wait_until(
        lambda: (e := registered(cp, agent)) and e["engine_id"] != first["engine_id"] and e,
        DEADLINE_S,
        "the agent to register again",
    )
    assert again["applied_version"] == 0
    assert len([e for e in cp.engines(RUN) if e["url"] == agent.url]) == 1


def test_an_agent_fails_over_between_control_planes_and_follows_the_store_without_one(
    setup: Setup, tiny: TinyCheckpoints
) -> None:
    cp = setup.cp()
    nobody = f"http://127.0.0.1:{free_port()}"
    agent = setup.agent(
        tiny,
        extra=("--control-plane", f"{nobody},{cp.url}"),
        env_overrides={"TETHER_TOKEN": cp.tokens["engine"]},
    )
    entry = wait_until(lambda: registered(cp, agent), DEADLINE_S, "the agent to register")
    assert entry["sync_state"] in ("booting", "ready")
    assert alive_info(agent)["control_plane"] == cp.url

    # No control plane answers: a version published to the store still reaches the engine.
    cp.process.stop()
    version = setup.chain.publish("full")
    info = wait_applied(agent, version, DEADLINE_S)
    assert info["sync_state"] == "ready"
    assert generate(agent.url or "", PROMPT).status_code == 200
