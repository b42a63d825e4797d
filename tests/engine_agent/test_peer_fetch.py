"""Peer-assisted fetch in a real fleet: a control plane, a folder store, reference engines
with an agent beside each, all as processes on 127.0.0.1 (docs/peers.md).

Agents A and B run throughout; agent C beside a third engine is started late, and again
after each change to what its peers hold, so it always catches up from its peers. The
store counts as read when an agent's pass says its bytes came from "store".
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine_agent import peer_fetch
from engine_agent.control_client import ControlClient
from engine_agent.peer_fetch import PeerFetch
from engine_agent.status import AgentStatus
from launcher.fault_proxy import ResettingProxy
from reference_engine.engine import weights_checksum
from store.layout import CLAIM_FILENAME, version_file_key
from store.manifest import INDEX_FILENAME
from store.sources import HttpSource, SourcedFetch
from store.store import Store
from store.types import VersionRef
from tests.engine_agent.conftest import (
    ControlPlaneProcess,
    VersionChain,
    launch_agent,
    server_info,
    wait_agent,
    wait_applied,
)
from tests.fixtures.processes import ManagedProcess, free_port, stop_all, wait_until
from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    launch_reference_engine,
    wait_until_ready,
)
from tests.store.chain import publish_chain, same_tensors
from wire.peers import (
    EARLIER_PLANNING_MAX,
    PEER_FILES_PATH,
    EarlierPlanning,
    FetchPlan,
    PeerSource,
    PlanningFiles,
    VersionLanes,
)

RUN = "peer-run"
CATCH_UP_S = 90.0
# C gives up on a silent peer quickly: the stall test needs no long wait.
QUICK_PEERS = {"TETHER_AGENT_PEER_WAIT_S": "1", "TETHER_AGENT_PEER_STALL_S": "1"}
PAST_REGISTRATION_WAIT_S = peer_fetch._REGISTRATION_WAIT_S + 2.0


@dataclass
class PeerFleet:
    root: Path
    chain: VersionChain
    cp: ControlPlaneProcess
    engines: dict[str, ReferenceEngineProcess]
    agents: dict[str, ManagedProcess]
    boot: Path
    # The newest FULL version: a catch-up from the boot version starts there (v0 is FULL).
    last_full: int = 0

    def publish(self, kind: str = "delta") -> int:
        version = self.chain.publish(kind)
        if kind == "full":
            self.last_full = version
        self.cp.notify(RUN, version)
        return version

    def version_bytes(self, version: int) -> int:
        info = self.chain.store._version_info(VersionRef(RUN, version))
        return sum(info.version_files.values())

    def start_late_agent(
        self, *extra: str, env: dict[str, str] | None = None, control_url: str | None = None
    ) -> ManagedProcess:
        """(Re)start agent C from the boot checkpoint (v0), with a fresh work dir; it calls
        the control plane at `control_url` (e.g. a fault proxy in front of it) if given."""
        old = self.agents.pop("c", None)
        if old is not None:
            old.stop()
        runs = len(list(self.root.glob("c-work-*")))
        cp = self.cp
        if control_url is not None:
            cp = ControlPlaneProcess(cp.process, control_url, cp.tokens)
        agent = launch_agent(
            f"agent-c{runs}", self.engines["c"].url, "bf16", self.root,
            store_root=self.chain.store_root, run_id=RUN, boot_model=self.boot,
            control_plane=cp, work_dir=self.root / f"c-work-{runs}",
            extra=tuple(extra), env_overrides=env,
        )  # fmt: skip
        self.agents["c"] = agent
        return wait_agent(agent)


@pytest.fixture(scope="module")
def fleet(tiny: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerFleet]:
    from tests.engine_agent.conftest import start_controlplane

    root = tmp_path_factory.mktemp("peers")
    engines = {
        name: launch_reference_engine(tiny.bf16, root / f"engine-{name}.log") for name in "abc"
    }
    # Long leases: a peer stopped with SIGSTOP stays in plans while C tries it. A peer that
    # a test's engine reports (bad bytes, a stall) is left out of plans for a short while
    # only: the reporting test's pass drops it by itself, and with the default 60 s a later
    # test whose plan needs A and B waited the suspicion out (40 s of 46 in a module run).
    cp = start_controlplane(root, {"TETHER_LEASE_SECONDS": "60", "TETHER_PEER_SUSPECT_S": "3"})
    chain = VersionChain(root / "store", RUN, tiny.bf16)
    reply = cp.call("POST", "/v1/runs", "trainer", json={"run_id": RUN})
    assert reply.status_code == 201, reply.text
    cp.notify(RUN, 0)
    agents: dict[str, ManagedProcess] = {}
    try:
        for name in "ab":
            agents[name] = launch_agent(
                f"agent-{name}", engines[name].url, "bf16", root,
                store_root=chain.store_root, run_id=RUN, boot_model=tiny.bf16,
                control_plane=cp,
            )  # fmt: skip
        for engine in engines.values():
            wait_until_ready(engine)
        for agent in agents.values():
            wait_agent(agent)
            wait_applied(agent, 0, CATCH_UP_S)
        yield PeerFleet(root, chain, cp, engines, agents, tiny.bf16)
    finally:
        stop_all([*agents.values(), *engines.values(), cp.process])


def pass_for(agent: ManagedProcess, version: int) -> dict:
    passes = [p for p in server_info(agent)["passes"] if p["committed"] == version]
    assert passes, f"{agent.name} has no pass that committed v{version}"
    return passes[-1]


def engine_checksum(engine: ReferenceEngineProcess) -> str:
    reply = httpx.post(f"{engine.url}/weights_checker", json={"action": "checksum"}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["message"]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def version_on_a_and_b(fleet: PeerFleet) -> int:
    """The newest version, applied by A and B. A test run alone (or first) finds only the
    boot version v0, which nobody fetches: it publishes a delta of its own then."""
    version = fleet.chain.latest or fleet.publish()
    for name in "ab":
        wait_applied(fleet.agents[name], version, CATCH_UP_S)
    return version


def test_engines_catching_up_together_read_each_file_from_the_store_once(
    fleet: PeerFleet,
) -> None:
    version = fleet.publish()
    for agent in (fleet.agents["a"], fleet.agents["b"]):
        wait_applied(agent, version, CATCH_UP_S)
    sources = [pass_for(fleet.agents[n], version)["bytes_from"] for n in "ab"]
    total = fleet.version_bytes(version)
    # Each shard comes from the store once and from a peer once. Two lanes over two engines
    # (their places on the plan's circle depend on their ids): either each is the root of
    # one lane, both have a peer and both hold the control plane's copy of the index, or
    # one is the root of both and reads the index from the store too.
    index = fleet.chain.store._version_info(VersionRef(RUN, version)).sizes[INDEX_FILENAME]
    assert sum(s.get("store", 0) for s in sources) in (total, total - index)
    assert sum(s.get("peer", 0) for s in sources) == total - index
    expected = weights_checksum(fleet.chain.torch_tensors(version))
    assert engine_checksum(fleet.engines["a"]) == engine_checksum(fleet.engines["b"]) == expected


def test_a_late_engine_catches_up_from_peers_while_the_store_cannot_serve_the_bytes(
    fleet: PeerFleet,
) -> None:
    target = version_on_a_and_b(fleet)
    store_root = fleet.chain.store_root
    # The store's shards turn to garbage of the same size (the index stays: it is how the
    # catch-up is planned): a catch-up that read them would fail its checksums.
    originals = {
        path: path.read_bytes()
        for v in range(1, target + 1)
        for path in (store_root / RUN / "updates" / f"weight_v{v:06d}").glob("*.safetensors")
    }
    for path, data in originals.items():
        path.write_bytes(bytes(len(data)))
    try:
        agent = fleet.start_late_agent()
        wait_applied(agent, target, CATCH_UP_S)
    finally:
        for path, data in originals.items():
            path.write_bytes(data)
    assert pass_for(agent, target)["bytes_from"].get("store", 0) == 0
    expected = weights_checksum(fleet.chain.torch_tensors(target))
    assert engine_checksum(fleet.engines["c"]) == expected


def full_version_on_a_and_b(fleet: PeerFleet) -> int:
    """A full version published and applied by A and B: a late C's catch-up then needs only
    its files, which A and B have just verified, whatever other tests did to the copies of
    earlier versions they keep for peers."""
    version = fleet.publish("full")
    for name in "ab":
        wait_applied(fleet.agents[name], version, CATCH_UP_S)
    return version


def test_a_late_engine_whose_plan_requests_fail_asks_again_and_fetches_from_its_peers(
    fleet: PeerFleet,
) -> None:
    version = full_version_on_a_and_b(fleet)
    # The control plane's connection is reset under C's first two plan requests, as an
    # overloaded one did at 1,000 engines (httpx ReadError); heartbeats get through.
    with ResettingProxy(fleet.cp.url) as proxy:
        proxy.reset_next_requests(2, b"GET /v1/engines/", b"/fetch-plan?")
        agent = fleet.start_late_agent(control_url=proxy.url)
        try:
            wait_applied(agent, version, CATCH_UP_S)
            bytes_from = pass_for(agent, version)["bytes_from"]
        finally:
            fleet.agents.pop("c").stop()
        assert proxy.resets == 2, "both plan requests were refused"
    # Asked again, the plan named A and B and came with the claim and index: nothing
    # from the store (answering the first failure with the store read it all).
    assert bytes_from.get("store", 0) == 0
    assert engine_checksum(fleet.engines["c"]) == weights_checksum(
        fleet.chain.torch_tensors(version)
    )


def test_a_new_engine_registered_late_waits_for_its_first_plan_and_fetches_from_its_peers(
    fleet: PeerFleet,
) -> None:
    version = full_version_on_a_and_b(fleet)
    # C starts while its control plane is out of reach (an overloaded one at a fleet's
    # start-up): it follows the store pointer and begins its catch-up unregistered.
    with ResettingProxy(fleet.cp.url) as proxy:
        proxy.partition()
        agent = fleet.start_late_agent(control_url=proxy.url)
        try:
            wait_until(
                lambda: server_info(agent)["staging_target"] == version,
                CATCH_UP_S,
                "C to begin its catch-up",
            )
            # The scenario, not a synchronisation: the registration comes later than the
            # 5 s a pass waits for a new id once the agent has had a plan.
            time.sleep(PAST_REGISTRATION_WAIT_S)
            proxy.heal()
            wait_applied(agent, version, CATCH_UP_S)
            bytes_from = pass_for(agent, version)["bytes_from"]
        finally:
            fleet.agents.pop("c").stop()
    # It waited for its id and a plan instead of reading the version from the store.
    assert bytes_from.get("store", 0) == 0
    assert sum(bytes_from.values()) > 0
    assert engine_checksum(fleet.engines["c"]) == weights_checksum(
        fleet.chain.torch_tensors(version)
    )


def test_a_peer_serving_corrupted_bytes_is_dropped_and_reported_and_none_of_its_bytes_used(
    fleet: PeerFleet,
) -> None:
    version = fleet.publish()
    for name in "ab":
        wait_applied(fleet.agents[name], version, CATCH_UP_S)
    # Every holder's verified copy of the new version is damaged after the fact.
    for name in "ab":
        for cached in (fleet.root / f"agent-{name}-work" / "peer-files").rglob("*.safetensors"):
            if f"weight_v{version:06d}" in str(cached):
                data = bytearray(cached.read_bytes())
                data[-5] ^= 0xFF
                cached.write_bytes(bytes(data))
    reports_before = metric(fleet.cp.url, "tether_peer_reports_total")
    agent = fleet.start_late_agent()
    wait_applied(agent, version, CATCH_UP_S)
    assert metric(agent.url or "", 'tether_agent_fetch_source_faults_total{reason="digest"}') >= 1
    assert metric(agent.url or "", "tether_agent_fetch_rejected_bytes_total") > 0
    assert pass_for(agent, version)["bytes_from"].get("store", 0) > 0
    assert engine_checksum(fleet.engines["c"]) == weights_checksum(
        fleet.chain.torch_tensors(version)
    )
    wait_until(
        lambda: metric(fleet.cp.url, "tether_peer_reports_total") > reports_before,
        30,
        "the control plane to count the report",
    )


def test_a_stalled_peer_is_dropped_within_its_deadline_and_the_store_serves(
    fleet: PeerFleet,
) -> None:
    version = fleet.publish()
    for name in "ab":
        wait_applied(fleet.agents[name], version, CATCH_UP_S)
    holders = [fleet.agents[n] for n in "ab"]
    for holder in holders:  # frozen: connections open, nothing ever answers
        os.killpg(holder.process.pid, signal.SIGSTOP)
    try:
        agent = fleet.start_late_agent(env=QUICK_PEERS)
        wait_applied(agent, version, CATCH_UP_S)
        assert (
            metric(agent.url or "", 'tether_agent_fetch_source_faults_total{reason="stall"}') >= 1
        )
    finally:
        for holder in holders:
            os.killpg(holder.process.pid, signal.SIGCONT)
    # C started from its boot version (v0): the newest FULL version and every delta since
    # came from the store, but for the indexes that came with the control plane's plan (the
    # target's, and those of the last `EARLIER_PLANNING_MAX` versions before it since v0).
    first = max(fleet.last_full, 1)
    relayed = range(max(first, version - EARLIER_PLANNING_MAX), version + 1)
    indexes = sum(
        fleet.chain.store._version_info(VersionRef(RUN, v)).sizes[INDEX_FILENAME] for v in relayed
    )
    needed = sum(fleet.version_bytes(v) for v in range(first, version + 1)) - indexes
    assert pass_for(agent, version)["bytes_from"].get("store", 0) == needed


def test_peer_files_need_an_engine_token_and_never_include_the_claim(fleet: PeerFleet) -> None:
    version = version_on_a_and_b(fleet)
    agent_url = fleet.agents["a"].url or ""
    key = version_file_key(VersionRef(RUN, version), "model.safetensors.index.json")

    def get(key: str, role: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {fleet.cp.tokens[role]}"} if role else {}
        return httpx.get(f"{agent_url}{PEER_FILES_PATH}/{key}", headers=headers, timeout=30)

    assert get(key, None).status_code == 401
    assert get(key, "client").status_code == 403
    held = get(key, "engine")
    assert held.status_code == 200
    assert held.content == (fleet.chain.store_root / key).read_bytes()
    ranged = httpx.get(
        f"{agent_url}{PEER_FILES_PATH}/{key}",
        headers={"Authorization": f"Bearer {fleet.cp.tokens['engine']}", "Range": "bytes=2-9"},
        timeout=30,
    )
    assert ranged.status_code == 206 and ranged.content == held.content[2:10]
    claim = version_file_key(VersionRef(RUN, version), CLAIM_FILENAME)
    assert get(claim, "engine").status_code == 404
    assert get(f"{RUN}/latest", "engine").status_code == 404


def test_with_peer_fetch_off_an_agent_reads_the_store_as_before_and_serves_nothing(
    fleet: PeerFleet,
) -> None:
    version = version_on_a_and_b(fleet)
    agent = fleet.start_late_agent("--no-peer-fetch")
    wait_applied(agent, version, CATCH_UP_S)
    assert pass_for(agent, version)["bytes_from"] == {}
    assert metric(agent.url or "", "tether_agent_fetched_bytes_total") == 0
    key = version_file_key(VersionRef(RUN, version), "model.safetensors.index.json")
    reply = httpx.get(
        f"{agent.url}{PEER_FILES_PATH}/{key}",
        headers={"Authorization": f"Bearer {fleet.cp.tokens['engine']}"},
        timeout=30,
    )
    assert reply.status_code == 404


def fetch_without_control_plane() -> PeerFetch:
    """An agent's fetch side with two configured HTTP sources and no control plane."""
    return PeerFetch(
        control=None, engine_id=lambda: None, own_url="http://127.0.0.1:9", token=None,
        status=AgentStatus(), configured=["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"],
        peers=False,
    )  # fmt: skip


def test_every_source_of_every_pass_shares_the_agents_one_http_client() -> None:
    fetch = fetch_without_control_plane()

    async def two_passes() -> list[HttpSource]:
        found = []
        for version in (1, 2):
            sourced = await fetch.sources(version)
            found += [s for s in sourced.sources if isinstance(s, HttpSource)]
            sourced.close()
        return found

    sources = asyncio.run(two_passes())
    assert len(sources) == 4
    assert all(s._client is fetch.client for s in sources)
    assert fetch.client is not None and not fetch.client.is_closed
    fetch.close()


def test_the_agents_rate_floor_reaches_every_http_source_it_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_agent.settings import AgentSettings

    # Read like every other setting (TETHER_AGENT_*); refused at 0, naming the field.
    monkeypatch.setenv("TETHER_AGENT_PEER_MIN_BYTES_PER_S", "2048")
    settings = AgentSettings(
        engine_url="http://127.0.0.1:9", precision="bf16", run="r", store="/tmp/s"
    )
    assert settings.peer_min_bytes_per_s == 2048
    monkeypatch.setenv("TETHER_AGENT_PEER_MIN_BYTES_PER_S", "0")
    with pytest.raises(ValueError, match="peer_min_bytes_per_s"):
        AgentSettings(engine_url="http://127.0.0.1:9", precision="bf16", run="r", store="/tmp/s")

    fetch = PeerFetch(
        control=None, engine_id=lambda: None, own_url="http://127.0.0.1:9", token=None,
        status=AgentStatus(), configured=["http://127.0.0.1:9/a"], min_bytes_per_s=2048,
    )  # fmt: skip
    sourced = asyncio.run(fetch.sources(1))
    peers = [s for lane in fetch._lanes([[peer("p", 1)]], {}) for s in lane]
    built = [s for s in [*sourced.sources, *peers] if isinstance(s, HttpSource)]
    assert [s.kind for s in built] == ["http", "peer"]
    assert all(s.min_bytes_per_s == 2048 for s in built)
    sourced.close()
    fetch.close()


def test_a_pass_asks_for_its_plan_without_waiting_and_its_fetch_thread_gets_the_sources() -> None:
    fetch = fetch_without_control_plane()

    async def one_pass() -> tuple[SourcedFetch, list[str]]:
        sourced = fetch.begin(3)  # returns before the plan is known
        # The store read (a worker thread) is where the sources are first needed.
        found = await asyncio.to_thread(lambda: [s.location for s in sourced.sources])
        return sourced, found

    sourced, found = asyncio.run(one_pass())
    assert found == ["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"]
    sourced.close()
    fetch.close()


def test_a_late_engine_plans_from_the_control_planes_claim_and_index_not_the_stores(
    fleet: PeerFleet,
) -> None:
    version = fleet.publish()
    for name in "ab":
        wait_applied(fleet.agents[name], version, CATCH_UP_S)
    # A's plan for the version names B, which holds it: the control plane reads the claim
    # and index (whether A and B named each other while fetching depends on timing).
    engine_a = fleet.cp.engine(RUN, fleet.agents["a"].url or "")
    assert engine_a is not None

    def planning() -> dict | None:
        path = f"/v1/engines/{engine_a['engine_id']}/fetch-plan?version={version}&planning=true"
        return fleet.cp.call("GET", path, "engine").json()["planning"]

    wait_until(planning, 30, "a fetch plan with the claim and index")
    index = fleet.chain.store_root / RUN / "updates" / f"weight_v{version:06d}" / INDEX_FILENAME
    original = index.read_bytes()
    # The store's index turns to garbage: a catch-up that read it could not be planned.
    index.write_bytes(bytes(len(original)))
    try:
        agent = fleet.start_late_agent()
        wait_applied(agent, version, CATCH_UP_S)
    finally:
        index.write_bytes(original)
    assert engine_checksum(fleet.engines["c"]) == weights_checksum(
        fleet.chain.torch_tensors(version)
    )


def peer(name: str, applied: int) -> PeerSource:
    return PeerSource(engine_id=name, url=f"http://{name}:1", applied_version=applied)


def test_without_a_plan_a_pass_follows_the_fetching_peers_of_the_last_plan_not_its_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peer_fetch, "PLAN_RETRY_S", 0.5)
    # A real client of a control plane that is not there: every call fails to connect.
    control = ControlClient(f"http://127.0.0.1:{free_port()}", token=None)
    fetch = PeerFetch(
        control=control, engine_id=lambda: "e", own_url="http://me:1", token=None,
        status=AgentStatus(), configured=[],
    )  # fmt: skip
    # The last plan (v3): in lane 0 a parent fetching v3 with this engine, then one that
    # held v3 (ordered by id, not by place: it may be behind this engine for v4); in lane 1
    # only a holder; lane 2 names this engine itself.
    fetch.last_plan = FetchPlan(
        version=3,
        peers=[peer("a", 2), peer("b", 3)],
        lanes=[[peer("a", 2), peer("b", 3)], [peer("c", 4)], [peer("me", 2)]],
        planning=PlanningFiles(claim="{}", index="{}"),
    )

    async def one_pass(version: int) -> tuple[list[list[str]], dict]:
        sourced = fetch.begin(version)
        relayed = await fetch.relayed(RUN, version)
        lanes = await asyncio.to_thread(
            lambda: [[s.location for s in sourced.order(lane)] for lane in range(3)]
        )
        sourced.close()
        return lanes, relayed

    lanes, relayed = asyncio.run(one_pass(4))
    assert lanes == [[f"http://a:1{PEER_FILES_PATH}"], [], []]
    assert relayed == {}, "the claim and index of v3 are not v4's"
    # A plan of a later version than the pass's is no guide: the store only.
    lanes, relayed = asyncio.run(one_pass(2))
    assert lanes == [[], [], []] and relayed == {}
    fetch.close()


def fetch_with_plan(plan: FetchPlan) -> tuple[PeerFetch, dict]:
    """`PeerFetch.relayed` for a pass whose fetch plan was `plan`."""
    fetch = PeerFetch(
        control=None, engine_id=lambda: "e", own_url="http://127.0.0.1:9", token=None,
        status=AgentStatus(), configured=[],
    )  # fmt: skip

    async def answered() -> FetchPlan:
        return plan

    async def one_pass() -> dict:
        fetch._plans = {plan.version: asyncio.ensure_future(answered())}
        return await fetch.relayed(RUN, plan.version)

    return fetch, asyncio.run(one_pass())


def test_a_claim_and_index_from_the_control_plane_that_disagree_are_refused(
    tmp_path: Path,
) -> None:
    store = Store(str(tmp_path / "store"))
    publish_chain(store, RUN, "FD")
    ref = VersionRef(RUN, 1)
    claim = store.objects.get(version_file_key(ref, CLAIM_FILENAME)).decode()
    index = store.objects.get(version_file_key(ref, INDEX_FILENAME)).decode()

    fetch, relayed = fetch_with_plan(
        FetchPlan(version=1, planning=PlanningFiles(claim=claim, index=index))
    )
    assert list(relayed) == [1] and relayed[1].index == index.encode()
    assert fetch.status.source_faults["relayed"] == 0

    tampered = index.replace('"000001"', '"000002"', 1)
    assert tampered != index
    fetch, relayed = fetch_with_plan(
        FetchPlan(version=1, planning=PlanningFiles(claim=claim, index=tampered))
    )
    assert relayed == {}, "a refused copy means: plan from the store"
    assert fetch.status.source_faults["relayed"] == 1

    fetch, relayed = fetch_with_plan(FetchPlan(version=1))
    assert relayed == {} and fetch.status.source_faults["relayed"] == 0


def test_the_claims_and_indexes_of_earlier_versions_in_a_plan_are_checked_one_by_one(
    tmp_path: Path,
) -> None:
    # An engine several versions behind plans its whole chain from the control plane's
    # copies: in a 1,000-engine cold start every engine read v1's index from the store,
    # queued ahead of the shards the fetch trees' roots read there.
    store = Store(str(tmp_path / "store"))
    publish_chain(store, RUN, "FDD")

    def files(version: int) -> tuple[str, str]:
        ref = VersionRef(RUN, version)
        return (
            store.objects.get(version_file_key(ref, CLAIM_FILENAME)).decode(),
            store.objects.get(version_file_key(ref, INDEX_FILENAME)).decode(),
        )

    def plan(version: int, *earlier: tuple[int, tuple[str, str]]) -> FetchPlan:
        """A plan for `version` with its own pair and (version, (claim, index)) pairs."""
        claim, index = files(version)
        return FetchPlan(
            version=version, planning=PlanningFiles(claim=claim, index=index),
            earlier=[EarlierPlanning(version=v, claim=c, index=i) for v, (c, i) in earlier],
        )  # fmt: skip

    fetch, relayed = fetch_with_plan(plan(2, (0, files(0)), (1, files(1))))
    assert sorted(relayed) == [0, 1, 2]
    assert relayed[1].index == files(1)[1].encode() and relayed[0].index == files(0)[1].encode()
    assert fetch.status.source_faults["relayed"] == 0
    # A pair that does not match (v1's claim sent as v0's) is left out alone; one that
    # claims a later version than the target is no part of this chain.
    fetch, relayed = fetch_with_plan(plan(1, (0, (files(1)[0], files(0)[1])), (2, files(2))))
    assert sorted(relayed) == [1]
    assert fetch.status.source_faults["relayed"] == 1
    # The materialized chain from those copies is the store's.
    _, relayed = fetch_with_plan(plan(2, (1, files(1))))
    assert same_tensors(store.materialize(RUN, 2, relayed=relayed), store.materialize(RUN, 2))


def test_a_file_of_an_earlier_version_is_asked_of_that_versions_own_lanes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In the target's trees an engine registered between two publications can rank above
    # one it ranks below in the earlier version's; each fetching the earlier version's
    # file by its own pass's plan, the two waited on each other until a timeout.
    fetch = PeerFetch(
        control=None, engine_id=lambda: "e", own_url="http://me:1", token=None,
        status=AgentStatus(), configured=[],
    )  # fmt: skip
    plan = FetchPlan(
        version=3,
        peers=[peer("a", 2)],
        lanes=[[peer("a", 2)], [peer("b", 2)]],
        version_lanes=[
            VersionLanes(version=2, lanes=[[peer("b", 1), peer("c", 1)], []]),
            VersionLanes(version=4, lanes=[[peer("d", 3)], [peer("d", 3)]]),  # not of this chain
        ],
    )

    async def planned(version: int, since: int | None = None) -> FetchPlan:
        return plan

    monkeypatch.setattr(fetch, "_plan", planned)

    async def one_pass() -> dict[int | None, list[list[str]]]:
        sourced = fetch.begin(3, since=1)
        orders = await asyncio.to_thread(
            lambda: {
                version: [
                    [s.location.removesuffix(PEER_FILES_PATH) for s in sourced.order(lane, version)]
                    for lane in range(2)
                ]
                for version in (None, 1, 2, 3)
            }
        )
        sourced.close()
        return orders

    orders = asyncio.run(one_pass())
    assert orders[3] == orders[None] == orders[1] == [["http://a:1"], ["http://b:1"]]
    # v2's lane 1 is the store's alone: none of the target's peers, whose trees differ.
    assert orders[2] == [["http://b:1", "http://c:1"], []]
    fetch.close()
