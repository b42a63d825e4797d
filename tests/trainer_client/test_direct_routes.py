"""The direct mode: `GET /v1/routes` candidate sets and `RolloutClient(direct=True)`, against
a real control plane and engine stand-ins whose versions move."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from demo.local_fleet import LocalControlPlane, start_controlplane
from launcher.processes import ManagedProcess, ProcessGroup
from tests.standins.joined import publish_chain, start_joined
from trainer_client.direct_routes import pick_less_loaded
from trainer_client.publisher import Publisher
from trainer_client.rollout_client import (
    PrecisionUnavailable,
    RolloutClient,
    RolloutRequestInvalid,
)
from wire import Precision, RouteCandidate

RUN = "direct"
DEADLINE_S = 30.0
# Long enough that a candidate set outlives an engine's version move within one test.
VALID_FOR_S = 30.0


@dataclass
class Fleet:
    cp: LocalControlPlane
    publisher: Publisher
    engines: dict[str, ManagedProcess]  # name -> stand-in
    group: ProcessGroup
    db_url: str
    store: str

    def routes(self, role: str | None = "client", **query: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.cp.tokens[role]}"} if role else {}
        return httpx.get(f"{self.cp.url}/v1/routes", params=query, headers=headers, timeout=10)

    def move(self, name: str, version: int) -> None:
        url = self.engines[name].url
        reply = httpx.post(f"{url}/control/version", json={"version": version}, timeout=10)
        assert reply.status_code == 200, reply.text

    def wait_listed(self, count: int, **query: object) -> list[dict]:
        """Poll `/v1/routes` until it lists `count` engines for the query."""
        end = time.monotonic() + DEADLINE_S
        while True:
            reply = self.routes(**query)
            if reply.status_code == 200 and len(reply.json()["engines"]) == count:
                return reply.json()["engines"]
            assert time.monotonic() < end, f"never {count} engines for {query}: {reply.text}"
            time.sleep(0.05)  # polling interval, bounded by the deadline

    def client(self, **options: float) -> RolloutClient:
        return RolloutClient(
            self.cp.url, self.cp.tokens["client"], run_id=RUN, direct=True, **options
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("direct")
    store = str(root / "store")
    db_url = f"sqlite:///{root / 'cp.db'}"
    with ProcessGroup(root / "logs") as group:
        cp = start_controlplane(
            group,
            db_url,
            store,
            env={"TETHER_ROUTE_SET_VALID_S": str(VALID_FOR_S)},
        )
        publisher = publish_chain(store, RUN, cp)
        engines = {
            name: start_joined(group, f"standin-{name}", cp, RUN, version=version,
                               precision=precision, extra=("--delay-s", "0.02"))
            for name, precision, version in (("a", "bf16", 1), ("b", "bf16", 1), ("c", "fp8", 2))
        }  # fmt: skip
        for engine in engines.values():
            engine.wait_http("/health", deadline_s=DEADLINE_S)
        result = Fleet(cp, publisher, engines, group, db_url, store)
        result.wait_listed(3, run_id=RUN)
        yield result
        publisher.close()


def test_the_candidate_set_lists_only_engines_that_meet_version_and_precision(
    fleet: Fleet,
) -> None:
    def urls(**query: object) -> set[str]:
        reply = fleet.routes(run_id=RUN, **query)
        assert reply.status_code == 200, reply.text
        return {e["url"] for e in reply.json()["engines"]}

    a, b, c = (fleet.engines[n].url for n in "abc")
    assert urls() == {a, b, c}
    assert urls(exact_version=1) == {a, b}
    assert urls(min_version=2) == {c}
    assert urls(precision="fp8") == {c}
    assert urls(precision=["bf16", "fp8"], min_version=1) == {a, b, c}
    body = fleet.routes(run_id=RUN, exact_version=2).json()
    assert body["run_id"] == RUN and body["valid_for_s"] == VALID_FOR_S
    (only,) = body["engines"]
    assert only["precision"] == "fp8" and only["applied_version"] == 2
    assert only["capacity"] == 8 and only["in_flight"] >= 0


def test_the_candidate_set_refuses_as_the_single_route_does(fleet: Fleet) -> None:
    for query in (
        {"run_id": "ghost"},
        {"run_id": RUN, "min_version": 4, "exact_version": 2},
        {"run_id": RUN, "precision": "nvfp4"},
        {"run_id": RUN, "min_version": 3},
        {"run_id": RUN, "exact_version": 100_000},
    ):
        many = fleet.routes(**query)
        one = httpx.get(
            f"{fleet.cp.url}/v1/route",
            params=query,
            headers={"Authorization": f"Bearer {fleet.cp.tokens['client']}"},
        )
        assert many.status_code == one.status_code, (query, many.text, one.text)
        assert many.status_code in (404, 409, 422), many.text
        assert many.json()["error"]["type"] == one.json()["error"]["type"]
    assert fleet.routes(run_id=RUN, min_version=3).json()["error"]["retryable"] is True


def test_the_candidate_set_needs_a_client_or_trainer_token(fleet: Fleet) -> None:
    assert fleet.routes(role=None, run_id=RUN).status_code == 401
    assert fleet.routes(role="engine", run_id=RUN).status_code == 403
    assert fleet.routes(role="trainer", run_id=RUN).status_code == 200


def test_the_direct_client_spreads_requests_over_the_eligible_engines(fleet: Fleet) -> None:
    async def scenario() -> tuple[list[tuple[str | None, int, str | None]], int]:
        async with fleet.client() as client:
            answers = await asyncio.gather(
                *(client.generate("1+1=", exact_version=1) for _ in range(40))
            )
            assert client.direct is not None
            return [
                (a.engine_id, a.weight_version_start, a.precision) for a in answers
            ], client.direct.stats.route_lookups

    answers, lookups = asyncio.run(scenario())
    assert {(v, p) for _, v, p in answers} == {(1, "bf16")}
    per_engine = Counter(e for e, _, _ in answers)
    listed = {e["engine_id"] for e in fleet.routes(run_id=RUN, exact_version=1).json()["engines"]}
    assert set(per_engine) == listed and len(listed) == 2
    assert min(per_engine.values()) >= 10, per_engine  # balanced by in-flight counts
    assert lookups < 40  # the set is reused, not asked for per request


def test_an_engine_whose_version_moved_is_dropped_and_another_serves(fleet: Fleet) -> None:
    a_id = next(
        e["engine_id"]
        for e in fleet.routes(run_id=RUN, exact_version=1).json()["engines"]
        if e["url"] == fleet.engines["a"].url
    )

    async def scenario() -> tuple[set[tuple[str | None, int]], int, int]:
        async with fleet.client() as client:
            assert client.direct is not None
            await client.generate("warm", exact_version=1)  # caches {a, b}
            fleet.move("a", 2)  # the cached set still lists a, now serving v2
            seen = set()
            for _ in range(50):  # a is drawn within a few (never drawn: p = 2**-50)
                answer = await client.generate("2+2=", exact_version=1)
                seen.add((answer.engine_id, answer.weight_version_start))
                if client.direct.stats.engines_dropped:
                    break
            return seen, client.direct.stats.engines_dropped, client.stats.retries

    try:
        seen, dropped, retries = asyncio.run(scenario())
    finally:
        fleet.move("a", 1)
        fleet.wait_listed(2, run_id=RUN, exact_version=1)
    assert dropped == 1
    assert retries == 0  # the next engine served it within the same call
    assert len(seen) == 1
    ((engine_id, version),) = seen
    assert engine_id != a_id and version == 1


def test_a_lapsed_candidate_set_is_asked_for_again(fleet: Fleet) -> None:
    # A second control plane on the same database, whose sets are valid for 0.2 s.
    brief = start_controlplane(
        fleet.group, fleet.db_url, fleet.store, env={"TETHER_ROUTE_SET_VALID_S": "0.2"}
    )

    async def scenario() -> tuple[int, int]:
        async with RolloutClient(
            brief.url, brief.tokens["client"], run_id=RUN, direct=True
        ) as client:
            assert client.direct is not None
            end = time.monotonic() + DEADLINE_S
            while client.direct.stats.route_lookups < 3:
                assert time.monotonic() < end, "the candidate set was never asked for again"
                answer = await client.generate("3+3=", exact_version=1)
                assert answer.weight_version_start == 1
            return client.direct.stats.route_lookups, client.direct.stats.engines_dropped

    try:
        lookups, dropped = asyncio.run(scenario())
    finally:
        brief.process.stop()
    assert lookups == 3
    assert dropped == 0  # so each new ask came from a set that had lapsed


def test_the_direct_client_raises_the_same_refusals(fleet: Fleet) -> None:
    async def scenario() -> None:
        async with fleet.client() as client:
            with pytest.raises(PrecisionUnavailable) as precision:
                await client.generate("x", precision="nvfp4")
            assert "fp8" in precision.value.fleet_precisions
            with pytest.raises(RolloutRequestInvalid, match="404"):
                async with RolloutClient(
                    fleet.cp.url, fleet.cp.tokens["client"], run_id="ghost", direct=True
                ) as ghost:
                    await ghost.generate("x")

    asyncio.run(scenario())


def test_a_session_stays_on_the_router_s_affinity_pick(fleet: Fleet) -> None:
    async def scenario() -> set[str | None]:
        async with fleet.client() as client:
            answers = [
                await client.generate("s", exact_version=1, session_id="session-42")
                for _ in range(6)
            ]
        return {a.engine_id for a in answers}

    engines = asyncio.run(scenario())
    assert len(engines) == 1 and None not in engines


def test_the_pick_prefers_fewer_requests_in_flight_per_unit_of_capacity() -> None:
    def engine(name: str, capacity: int) -> RouteCandidate:
        return RouteCandidate(
            engine_id=name,
            url=f"http://{name}",
            precision=Precision.BF16,
            applied_version=1,
            capacity=capacity,
            in_flight=0,
        )

    small, big = engine("small", 2), engine("big", 16)
    rng = random.Random(7)
    # 2 in flight on a capacity of 2 is a full engine; 8 on 16 is half full.
    picks = {
        pick_less_loaded([small, big], {"small": 2, "big": 8}, rng).engine_id  # type: ignore[union-attr]
        for _ in range(20)
    }
    assert picks == {"big"}
    picks = {
        pick_less_loaded([small, big], {"small": 0, "big": 1}, rng).engine_id  # type: ignore[union-attr]
        for _ in range(20)
    }
    assert picks == {"small"}
    assert pick_less_loaded([], {}, rng) is None
