"""The RolloutClient against a real control plane and engine stand-ins whose versions move."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

from demo.local_fleet import LocalControlPlane, start_controlplane
from launcher.processes import ManagedProcess, ProcessGroup, free_port
from store.types import VersionConstraint
from tests.standins.joined import publish_chain, start_joined
from trainer_client.publisher import Publisher
from trainer_client.rollout_client import (
    PrecisionUnavailable,
    RolloutClient,
    RolloutDeadlineExceeded,
    RolloutRequestInvalid,
    VersionUnavailable,
    backoff_delay,
    retry_after_seconds,
)
from trainer_client.rollout_result import Delivery, parse_chat, parse_generate

RUN = "rollouts"
DEADLINE_S = 30.0


@dataclass
class Fleet:
    cp: LocalControlPlane
    publisher: Publisher
    engines: dict[str, ManagedProcess]  # precision -> stand-in

    def serve(self, precision: str, version: int) -> None:
        """Move one stand-in to `version` and wait until the router routes to it there."""
        url = self.engines[precision].url
        reply = httpx.post(f"{url}/control/version", json={"version": version}, timeout=10)
        assert reply.status_code == 200, reply.text
        query = {"run_id": RUN, "exact_version": version, "precision": precision}
        headers = {"Authorization": f"Bearer {self.cp.tokens['client']}"}
        end = time.monotonic() + DEADLINE_S
        while (
            httpx.get(f"{self.cp.url}/v1/route", params=query, headers=headers).status_code != 200
        ):
            assert time.monotonic() < end, f"the router never routed to {precision} on v{version}"
            time.sleep(0.05)  # polling interval, bounded by the deadline

    def client(self, **options: float) -> RolloutClient:
        return RolloutClient(self.cp.url, self.cp.tokens["client"], run_id=RUN, **options)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("rollouts")
    store = str(root / "store")
    with ProcessGroup(root / "logs") as group:
        cp = start_controlplane(group, f"sqlite:///{root / 'cp.db'}", store)
        publisher = publish_chain(store, RUN, cp)
        engines = {
            precision: start_joined(group, f"standin-{precision}", cp, RUN, version=version,
                                    precision=precision)
            for precision, version in (("bf16", 1), ("fp8", 2))
        }  # fmt: skip
        for engine in engines.values():
            engine.wait_http("/health", deadline_s=DEADLINE_S)
        result = Fleet(cp, publisher, engines)
        result.serve("bf16", 1)
        result.serve("fp8", 2)
        yield result
        publisher.close()


def test_exact_version_requests_go_only_to_the_engine_serving_that_version(fleet: Fleet) -> None:
    async def scenario() -> list[tuple[int, str | None]]:
        async with fleet.client() as client:
            answers = [await client.generate("1+1=", exact_version=v) for v in (1, 2, 1, 2)]
        return [(a.weight_version_start, a.precision) for a in answers]

    assert asyncio.run(scenario()) == [(1, "bf16"), (2, "fp8"), (1, "bf16"), (2, "fp8")]


def test_max_lag_raises_the_minimum_to_latest_minus_lag(fleet: Fleet) -> None:
    async def scenario() -> tuple[VersionConstraint, list[int], int]:
        async with fleet.client() as client:
            constraint = await client.constraint_for(max_lag=1)
            answers = [await client.generate([5, 6, 7], max_lag=1) for _ in range(4)]
            return constraint, [a.weight_version_start for a in answers], client.stats.retries

    constraint, versions, retries = asyncio.run(scenario())
    assert constraint == VersionConstraint(min_version=2)  # latest is v3
    assert versions == [2, 2, 2, 2]  # the v1 engine is never eligible
    assert retries == 0


def test_a_min_version_request_retries_409s_until_an_engine_catches_up(fleet: Fleet) -> None:
    async def scenario() -> tuple[int, int, int]:
        async with fleet.client(backoff_base_s=0.02, backoff_cap_s=0.2) as client:
            request = asyncio.create_task(client.generate("2+2=", min_version=3))
            end = time.monotonic() + DEADLINE_S
            while client.stats.retries_409 < 2:  # refused at least twice: nobody serves v3
                assert time.monotonic() < end and not request.done()
                await asyncio.sleep(0.02)  # polling interval, bounded by the deadline
            await asyncio.to_thread(fleet.serve, "fp8", 3)
            answer = await request
            return answer.weight_version_start, answer.not_ready_retries, answer.retries

    try:
        start, not_ready, retries = asyncio.run(scenario())
    finally:
        fleet.serve("fp8", 2)
    assert start == 3
    assert not_ready >= 2 and retries >= not_ready


def test_a_version_nobody_serves_fails_at_the_deadline_with_the_last_answer(
    fleet: Fleet,
) -> None:
    async def scenario() -> tuple[str, int, int]:
        async with fleet.client(backoff_base_s=0.02, backoff_cap_s=0.1) as client:
            started = time.monotonic()
            with pytest.raises(RolloutDeadlineExceeded) as caught:
                await client.generate("3+3=", exact_version=3, deadline_s=1.0)
            assert time.monotonic() - started < 5.0
            return str(caught.value), client.stats.retries_409, client.stats.deadline_exceeded

    message, refusals, deadlines = asyncio.run(scenario())
    assert "exactly v3" in message and "WeightVersionNotReady" in message
    assert refusals >= 2 and deadlines == 1


def test_an_invalid_request_fails_at_once_without_retries(fleet: Fleet) -> None:
    async def scenario() -> tuple[str, int]:
        async with fleet.client() as client:
            with pytest.raises(RolloutRequestInvalid) as caught:
                await client.generate("4+4=", precision="fp16")
            return str(caught.value), client.stats.retries

    message, retries = asyncio.run(scenario())
    assert "precision" in message and retries == 0


def test_a_version_no_engine_will_serve_again_fails_at_once_naming_the_nearest(
    fleet: Fleet,
) -> None:
    async def scenario() -> tuple[int | None, int]:
        async with fleet.client() as client:
            with pytest.raises(VersionUnavailable) as caught:
                await client.generate("5+5=", exact_version=0)  # below both engines, latest v3
            return caught.value.nearest_servable_version, client.stats.retries

    nearest, retries = asyncio.run(scenario())
    assert nearest == 1 and retries == 0


def test_a_precision_no_engine_has_and_an_unknown_run_fail_at_once(fleet: Fleet) -> None:
    async def scenario() -> tuple[list[str], str, int]:
        async with fleet.client() as client:
            with pytest.raises(PrecisionUnavailable) as caught:
                await client.generate("6+6=", precision="nvfp4")
            fleet_precisions = caught.value.fleet_precisions
        async with RolloutClient(fleet.cp.url, fleet.cp.tokens["client"], run_id="ghost") as lost:
            with pytest.raises(RolloutRequestInvalid) as unknown:
                await lost.generate("7+7=", min_version=1)
        return fleet_precisions, str(unknown.value), client.stats.retries + lost.stats.retries

    fleet_precisions, unknown, retries = asyncio.run(scenario())
    assert sorted(fleet_precisions) == ["bf16", "fp8"]
    assert "404" in unknown and "RunUnknown" in unknown
    assert retries == 0


def test_retry_after_is_read_in_seconds_and_backoff_is_jittered_below_its_cap() -> None:
    assert retry_after_seconds({"retry-after": "0.5"}) == 0.5
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None
    delays = [backoff_delay(attempt, 0.05, 1.0) for attempt in range(1, 12) for _ in range(20)]
    assert all(0.0 <= d <= 1.0 for d in delays)
    assert len(set(delays)) > 100  # jittered, not a fixed schedule


def test_sglang_answers_parse_into_tokens_logprobs_top_k_and_version_spans() -> None:
    import torch as t

    from reference_engine.request import GenerationRequest
    from reference_engine.sampling import SamplingParams

    request = GenerationRequest(
        rid="r1",
        input_ids=[1, 2],
        params=SamplingParams(),
        generator=t.Generator(),
        sink=lambda _body, _done: None,
        return_logprob=True,
        top_logprobs_num=2,
    )
    request.output_ids = [7, 8, 9]
    request.output_logprobs = [-0.1, -0.2, -0.3]
    request.output_top = [[(-0.1, 7), (-2.0, 3)], [(-0.2, 8), (-1.9, 4)], [(-0.3, 9), (-1.5, 5)]]
    request.text = "789"
    request.version_events = [("4", 2)]  # tokens 0-1 came from v4, the rest from v5
    request.finish_reason = {"type": "length"}
    body = request.response("5", "5", str)
    body.update(weight_version_start=4, weight_version_end=5, engine_id="e1", precision="fp8")

    result = parse_generate(body, Delivery({}, VersionConstraint(min_version=4), retries=2))
    assert result.output_ids == [7, 8, 9] and result.logprobs == [-0.1, -0.2, -0.3]
    assert [(c.token_id, c.logprob) for c in result.top_logprobs[0]] == [
        (7, -0.1),
        (3, -2.0),
    ]
    assert [(s.version, s.start, s.end) for s in result.spans] == [(4, 0, 2), (5, 2, 3)]
    assert (result.oldest_version, result.engine_id, result.precision) == (4, "e1", "fp8")
    assert result.satisfies_constraint
    assert result.retries == 2
    pinned = parse_generate(body, Delivery({}, VersionConstraint(exact_version=5)))
    assert not pinned.satisfies_constraint  # tokens 0-1 came from v4


def test_openai_chat_answers_parse_with_their_version_metadata() -> None:
    body = {
        "choices": [
            {
                "message": {"role": "assistant", "content": "8"},
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {"token": "8", "logprob": -0.5, "top_logprobs": [
                            {"token": "8", "logprob": -0.5}, {"token": "9", "logprob": -1.5}]}
                    ]
                },
            }
        ],
        "metadata": {"weight_version": "6"},
        "engine_id": "e2",
        "precision": "nvfp4",
    }  # fmt: skip
    result = parse_chat(body, Delivery({"X-Tether-Weight-Version-Start": "6"}, VersionConstraint()))
    assert (result.text, result.logprobs) == ("8", [-0.5])
    assert [c.token for c in result.top_logprobs[0]] == ["8", "9"]
    assert (result.weight_version_start, result.weight_version_end) == (6, 6)


def test_the_gap_report_reaches_the_control_plane_and_a_client_token_is_refused(
    fleet: Fleet,
) -> None:
    from trainer_client.gap_metrics import gap_metrics

    measured = gap_metrics(
        torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.1, -2.3]]), torch.ones(1, 2)
    )

    async def scenario() -> tuple[bool, int]:
        trainer = RolloutClient(fleet.cp.url, fleet.cp.tokens["trainer"], run_id=RUN)
        async with trainer:
            ok = await trainer.report_gap(
                7, {"fp8": measured, "bf16": {"k3_kl": 0.001}}, trainer_version=3,
                staleness_mean=1.5, staleness_max=2,
            )  # fmt: skip
            reported = trainer.stats.gap_reports
        async with fleet.client() as client:
            with pytest.raises(RolloutRequestInvalid, match="403"):
                await client.report_gap(8, {"fp8": measured})
        return ok, reported

    ok, reported = asyncio.run(scenario())
    assert ok and reported == 1
    (run,) = fleet.cp.get("/v1/fleet/overview", "viewer")["runs"]
    (entry,) = [g for g in run["gap"] if g["step"] == 7]
    assert entry["precisions"]["fp8"]["k3_kl"] == pytest.approx(measured.k3_kl)
    assert entry["precisions"]["fp8"]["tokens"] == 2
    assert entry["trainer_version"] == 3 and entry["staleness_max"] == 2
    assert [g["step"] for g in run["gap"]] == [7]  # the refused report stored nothing


def test_an_unreachable_control_plane_does_not_stop_training() -> None:
    async def scenario() -> tuple[bool, int]:
        url = f"http://127.0.0.1:{free_port()}"
        async with RolloutClient(url, "tth_x", run_id=RUN) as client:
            return await client.report_gap(1, {"bf16": {"k3_kl": 0.1}}), (
                client.stats.gap_reports_failed
            )

    assert asyncio.run(scenario()) == (False, 1)
