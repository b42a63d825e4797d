"""Engine agents in a real fleet: control plane, folder store, reference engines in BF16, FP8
and NVFP4, one agent beside each, all as processes on 127.0.0.1.

The module shares one fleet (starting processes is the expensive part); every test starts
from whatever version the fleet is on and publishes what it needs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from reference_engine.engine import weights_checksum
from tests.engine_agent.conftest import (
    ControlPlaneProcess,
    VersionChain,
    generate,
    launch_agent,
    server_info,
    wait_agent,
    wait_applied,
)
from tests.fixtures.processes import ManagedProcess, metric, stop_all, wait_until
from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    launch_reference_engine,
    start_reference_engine,
    wait_until_ready,
)

RUN = "fleet-run"
PRECISIONS = ("bf16", "fp8", "nvfp4")
SEEDED = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "max_new_tokens": 12, "sampling_seed": 7}
CATCH_UP_S = 90.0


@dataclass
class Fleet:
    root: Path
    chain: VersionChain
    cp: ControlPlaneProcess
    engines: dict[str, ReferenceEngineProcess]
    agents: dict[str, ManagedProcess]
    boots: dict[str, Path]

    def wait_all_applied(self, version: int) -> dict[str, dict]:
        return {p: wait_applied(a, version, CATCH_UP_S) for p, a in self.agents.items()}

    def agent_urls(self) -> set[str]:
        return {agent.url for agent in self.agents.values() if agent.url}

    def publish(self, kind: str = "delta", *, corrupt: bool = False) -> int:
        version = self.chain.publish(kind, corrupt=corrupt)
        self.cp.notify(RUN, version)
        return version


@pytest.fixture(scope="module")
def fleet(tiny: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from tests.engine_agent.conftest import start_controlplane

    root = tmp_path_factory.mktemp("fleet")
    boots = {"bf16": tiny.bf16, "fp8": tiny.fp8, "nvfp4": tiny.nvfp4}
    engines = {p: launch_reference_engine(boots[p], root / f"engine-{p}.log") for p in PRECISIONS}
    cp = start_controlplane(root)
    chain = VersionChain(root / "store", RUN, tiny.bf16)
    reply = cp.call("POST", "/v1/runs", "trainer", json={"run_id": RUN})
    assert reply.status_code == 201, reply.text
    cp.notify(RUN, 0)
    agents: dict[str, ManagedProcess] = {}
    try:
        # Agents start beside engines that are still loading: they wait for their engine.
        for precision, engine in engines.items():
            agents[precision] = launch_agent(
                f"agent-{precision}", engine.url, precision, root,
                store_root=chain.store_root, run_id=RUN, boot_model=boots[precision],
                control_plane=cp,
            )  # fmt: skip
        for engine in engines.values():
            wait_until_ready(engine)
        for agent in agents.values():
            wait_agent(agent)
        fleet = Fleet(root, chain, cp, engines, agents, boots)
        fleet.wait_all_applied(0)
        yield fleet
    finally:
        stop_all([*agents.values(), *engines.values(), cp.process])


def engine_checksum(engine: ReferenceEngineProcess) -> str:
    reply = httpx.post(f"{engine.url}/weights_checker", json={"action": "checksum"}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["message"]


def test_catch_up_across_full_and_delta_versions_matches_the_published_bytes(
    fleet: Fleet, tmp_path: Path
) -> None:
    from engine_agent.precision import convert_checkpoint, read_input_scales

    start = fleet.chain.latest
    for kind in ("delta", "delta"):
        fleet.publish(kind)
    middle = fleet.chain.latest
    fleet.wait_all_applied(middle)
    assert engine_checksum(fleet.engines["bf16"]) == weights_checksum(
        fleet.chain.torch_tensors(middle)
    )
    for kind in ("full", "delta"):
        fleet.publish(kind)
    target = fleet.chain.latest
    infos = fleet.wait_all_applied(target)

    # BF16: the engine holds the canonical tensors bit for bit.
    assert engine_checksum(fleet.engines["bf16"]) == weights_checksum(
        fleet.chain.torch_tensors(target)
    )
    # FP8 / NVFP4: the staged folder is byte-identical to a fresh conversion of the version.
    canonical = fleet.chain.write_folder(target, tmp_path / "canonical")
    for precision in ("fp8", "nvfp4"):
        scales = read_input_scales(fleet.boots["nvfp4"]) if precision == "nvfp4" else None
        fresh = tmp_path / f"fresh-{precision}"
        convert_checkpoint(canonical, precision, fresh, scales)
        staged = fleet.root / f"agent-{precision}-work" / "staged" / f"v{target:06d}-{precision}"
        assert (staged / "model.safetensors").read_bytes() == (
            fresh / "model.safetensors"
        ).read_bytes()
        assert json.loads((staged / "config.json").read_text()) == json.loads(
            (fresh / "config.json").read_text()
        )
    for precision, info in infos.items():
        last = info["last_pass"]
        # A pass that saw the target move while staging restages once: it commits the newer.
        assert last["outcome"] == "committed" and last["committed"] == target, precision
        assert last["pause_s"] > 0 and last["stage_s"] > 0, precision
    assert start < middle < target

    # Generation under a fixed seed equals a fresh engine loaded with the version directly
    # (BF16: the canonical folder; NVFP4: its fresh conversion).
    folders = {"bf16": canonical, "nvfp4": tmp_path / "fresh-nvfp4"}
    fresh = {
        p: launch_reference_engine(folder, tmp_path / f"direct-{p}.log")
        for p, folder in folders.items()
    }
    body = {"text": "1 + 2 =", "sampling_params": SEEDED, "return_logprob": True}
    try:
        for precision, engine in fresh.items():
            wait_until_ready(engine)
            direct = generate(engine.url, body)
            proxied = generate(fleet.agents[precision].url, body)
            assert direct.status_code == proxied.status_code == 200, proxied.text
            assert proxied.json()["output_ids"] == direct.json()["output_ids"], precision
            assert (
                proxied.json()["meta_info"]["output_token_logprobs"]
                == (direct.json()["meta_info"]["output_token_logprobs"])
            ), precision
            stamped = proxied.json()["weight_version_start"], proxied.json()["weight_version_end"]
            assert stamped == (target, target), precision
    finally:
        stop_all(fresh.values())


def test_each_agent_warmed_its_decoders_and_its_precision_s_conversion_at_boot(
    fleet: Fleet,
) -> None:
    # What each warm-up leaves to the first catch-up: tests/store/test_codec_warm.py and
    # tests/engine_agent/test_precision_warm.py.
    for precision, agent in fleet.agents.items():
        assert metric(agent.url or "", "tether_agent_codecs_warm_seconds") > 0, precision
        converted = metric(agent.url or "", "tether_agent_conversion_warm_seconds")
        assert (converted > 0) == (precision != "bf16"), (precision, converted)


def test_agent_registers_again_when_the_control_plane_forgets_it(fleet: Fleet) -> None:
    agent = fleet.agents["fp8"]
    # Listed only while its 5 s lease is current: a heartbeat can come late on a busy machine.
    before = wait_until(lambda: fleet.cp.engine(RUN, agent.url), CATCH_UP_S, "the fp8 agent")
    gone = fleet.cp.call("DELETE", f"/v1/engines/{before['engine_id']}", "engine")
    assert gone.status_code == 204

    def registered_again() -> dict | None:
        entry = fleet.cp.engine(RUN, agent.url)
        return entry if entry and entry["engine_id"] != before["engine_id"] else None

    again = wait_until(registered_again, CATCH_UP_S, "the agent to register again")
    assert again["applied_version"] == before["applied_version"]
    assert server_info(agent)["engine_id"] == again["engine_id"]


def test_min_version_request_gets_409_then_succeeds_after_catch_up(fleet: Fleet) -> None:
    agent = fleet.agents["fp8"]
    served = server_info(agent)["applied_version"]
    body = {
        "text": "3 + 4 =",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "weight_version": {"min_version": served + 1},
    }
    refused = generate(agent.url, body)
    assert refused.status_code == 409
    assert refused.headers["retry-after"]
    error = refused.json()["error"]
    assert error["type"] == "WeightVersionNotReady" and error["retryable"] is True
    assert error["served_version"] == served

    version = fleet.publish()

    def answered() -> httpx.Response | None:
        reply = generate(agent.url, body)
        return reply if reply.status_code == 200 else None

    reply = wait_until(answered, CATCH_UP_S, f"a v{version} answer")
    assert reply.json()["weight_version_start"] == version
    assert reply.headers["x-tether-weight-version-start"] == str(version)
    fleet.wait_all_applied(version)


def test_exact_pinned_request_in_flight_delays_the_commit_and_is_answered_on_its_version(
    fleet: Fleet,
) -> None:
    agent = fleet.agents["bf16"]
    pinned = server_info(agent)["applied_version"]
    body = {
        "text": "5 + 6 =",
        "stream": True,
        "sampling_params": {"max_new_tokens": 600, "temperature": 0.0, "ignore_eos": True},
        "weight_version": {"exact_version": pinned},
    }
    chunks: list[dict] = []

    def stream() -> None:
        with httpx.stream("POST", f"{agent.url}/generate", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: ") :]))

    # No race with the generation's speed: the engine is held (paused in place) before the
    # pinned request is sent, so it stays in flight however fast the machine is and however
    # long staging takes; the commit never pauses the engine before the gate drains.
    engine_url = fleet.engines["bf16"].url
    hold = httpx.post(f"{engine_url}/pause_generation", json={"mode": "in_place"}, timeout=10)
    assert hold.status_code == 200, hold.text
    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: server_info(agent)["in_flight"] >= 1, 60, "the pinned request admitted")
    try:
        version = fleet.publish()
        # Staged and ready to commit, but held back: admission closed while the pin is in
        # flight.
        wait_until(
            lambda: not server_info(agent)["admission_open"] or not reader.is_alive(),
            CATCH_UP_S,
            "the commit to wait at the closed gate",
        )
        assert reader.is_alive(), "the pinned request finished before the commit was ready"
        assert server_info(agent)["applied_version"] == pinned
    finally:
        httpx.post(f"{engine_url}/continue_generation", json={}, timeout=10)
    reader.join(120)
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["meta_info"]["weight_versions"] == [
        {"version": str(pinned), "start": 0, "end": 600}
    ]
    assert final["weight_version_start"] == final["weight_version_end"] == pinned
    info = wait_applied(agent, version, CATCH_UP_S)
    assert info["last_pass"]["drain_s"] > 0.05


def test_corrupted_delta_is_never_committed_and_the_error_reaches_the_heartbeat(
    fleet: Fleet,
) -> None:
    before = fleet.chain.latest
    fleet.wait_all_applied(before)
    bad = fleet.publish(corrupt=True)

    def errors_reported() -> list[dict] | None:
        engines = [e for e in fleet.cp.engines(RUN) if e["url"] in fleet.agent_urls()]
        reported = [e for e in engines if e["last_error"] and f"v{bad}" in e["last_error"]]
        return engines if len(reported) == len(fleet.agents) else None

    engines = wait_until(errors_reported, CATCH_UP_S, "every agent to report the bad version")
    for engine in engines:
        assert engine["applied_version"] == before
        assert engine["sync_state"] in ("ready", "syncing")
    for agent in fleet.agents.values():
        reply = generate(agent.url, {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 2}})
        assert reply.status_code == 200
        assert reply.json()["weight_version_start"] == before

    good = fleet.publish("full")
    fleet.wait_all_applied(good)
    assert all(e["last_error"] is None for e in fleet.cp.engines(RUN)
               if e["url"] in fleet.agent_urls())  # fmt: skip


@pytest.fixture(scope="module")
def joiner(
    fleet: Fleet, tiny: TinyCheckpoints
) -> Iterator[tuple[ReferenceEngineProcess, ManagedProcess]]:
    """A BF16 engine booted from v0 whose agent joins the fleet later (started by the test)."""
    engine = start_reference_engine(tiny.bf16, fleet.root / "engine-joiner.log")
    started: list[ManagedProcess] = []
    yield engine, started  # type: ignore[misc]
    stop_all([*started, engine])


def test_agent_joining_mid_run_enters_routing_only_after_it_caught_up(
    fleet: Fleet, joiner, tiny: TinyCheckpoints
) -> None:
    engine, started = joiner
    # The run's newest version is unreadable, so the joiner cannot finish catching up yet.
    before = fleet.chain.latest
    fleet.publish(corrupt=True)
    agent = launch_agent(
        "agent-joiner", engine.url, "bf16", fleet.root, store_root=fleet.chain.store_root,
        run_id=RUN, boot_model=tiny.bf16, control_plane=fleet.cp,
    )  # fmt: skip
    started.append(agent)
    wait_agent(agent)
    entry = wait_until(
        lambda: (e := fleet.cp.engine(RUN, agent.url)) and e["last_error"] and e,
        CATCH_UP_S,
        "the joiner to register and report its failed catch-up",
    )
    assert entry["sync_state"] == "booting" and entry["applied_version"] == 0
    assert httpx.get(f"{agent.url}/health").status_code == 503
    # It serves v0, but the router must not send it anything before it caught up.
    route = fleet.cp.call("GET", "/v1/route", "client", params={"run_id": RUN, "exact_version": 0})
    assert route.status_code == 409, route.text

    good = fleet.publish("full")
    info = wait_applied(agent, good, CATCH_UP_S)
    assert info["sync_state"] == "ready" and info["last_pass"]["base"] == 0
    assert before < good
    entry = wait_until(
        lambda: (e := fleet.cp.engine(RUN, agent.url)) and e["sync_state"] == "ready" and e,
        CATCH_UP_S,
        "the joiner to enter routing",
    )
    assert entry["applied_version"] == good
    assert httpx.get(f"{agent.url}/health").status_code == 200
    fleet.wait_all_applied(good)


def test_killed_engine_is_reported_and_leaves_routing(fleet: Fleet, joiner) -> None:
    engine, started = joiner
    if not started:
        pytest.skip("needs the joiner started by the previous test")
    agent = started[0]
    wait_until(
        lambda: (e := fleet.cp.engine(RUN, agent.url)) and e["sync_state"] == "ready",
        CATCH_UP_S,
        "the joiner to be ready",
    )
    engine.process.kill()
    engine.process.wait(10)
    entry = wait_until(
        lambda: (e := fleet.cp.engine(RUN, agent.url)) and e["sync_state"] == "error" and e,
        CATCH_UP_S,
        "the agent to report its engine gone",
    )
    assert "EngineUnreachable" in entry["last_error"]
    reply = generate(agent.url, {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 503 and reply.headers["retry-after"]
    engine_id = entry["engine_id"]
    for _ in range(10):
        route = fleet.cp.call("GET", "/v1/route", "client", params={"run_id": RUN})
        assert route.status_code == 200 and route.json()["engine_id"] != engine_id

    # SIGTERM: the agent deregisters and exits cleanly.
    assert agent.stop() == 0
    assert fleet.cp.engine(RUN, agent.url) is None
