"""The admission gate on its own: constraint check and version capture are one atomic step,
and a commit waits for the exact-version requests in flight on the version it replaces."""

from __future__ import annotations

import asyncio

import pytest

from engine_agent.gate import AdmissionGate, VersionNotReady
from store.types import VersionConstraint

ANY = VersionConstraint()


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_a_request_is_admitted_on_the_served_version_and_counted_in_flight() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(7)
        admission = await gate.admit(VersionConstraint(min_version=5))
        assert admission.version == 7 and not admission.exact
        assert gate.in_flight == 1
        await gate.release(admission)
        assert gate.in_flight == 0

    run(scenario())


def test_a_mismatched_constraint_is_refused_and_wakes_the_reconciler() -> None:
    woken: list[VersionConstraint] = []

    async def scenario() -> None:
        gate = AdmissionGate(7, on_reject=woken.append)
        with pytest.raises(VersionNotReady) as refused:
            await gate.admit(VersionConstraint(min_version=8))
        assert refused.value.served == 7
        with pytest.raises(VersionNotReady):
            await gate.admit(VersionConstraint(exact_version=6))
        assert gate.in_flight == 0

    run(scenario())
    assert woken == [VersionConstraint(min_version=8), VersionConstraint(exact_version=6)]


def test_nothing_is_admitted_before_the_engine_serves_a_known_version() -> None:
    async def scenario() -> None:
        with pytest.raises(VersionNotReady):
            await AdmissionGate(None).admit(ANY)

    run(scenario())


def test_requests_arriving_during_a_commit_wait_and_run_on_the_new_version() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(7, wait_s=5)
        await gate.close()
        waiting = asyncio.ensure_future(gate.admit(VersionConstraint(min_version=8)))
        await asyncio.sleep(0)  # let it reach the gate
        assert not waiting.done()
        await gate.reopen(8)
        admission = await waiting
        assert admission.version == 8

    run(scenario())


def test_a_commit_that_keeps_the_gate_closed_too_long_turns_waiters_into_409s() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(7, wait_s=0.05)
        await gate.close()
        with pytest.raises(VersionNotReady) as refused:
            await gate.admit(ANY)
        assert "in progress" in refused.value.reason

    run(scenario())


def test_commit_waits_for_exact_requests_in_flight_on_the_old_version() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(7)
        pinned = await gate.admit(VersionConstraint(exact_version=7))
        loose = await gate.admit(ANY)
        await gate.close()
        drained = asyncio.ensure_future(gate.wait_exact_drained(7, timeout_s=5))
        await asyncio.sleep(0)
        await gate.release(loose)  # a request without a pin does not hold the commit
        await asyncio.sleep(0)
        assert not drained.done()
        await gate.release(pinned)
        assert await drained == 0

    run(scenario())


def test_the_wait_for_pinned_requests_is_bounded() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(7)
        await gate.admit(VersionConstraint(exact_version=7))
        assert await gate.wait_exact_drained(7, timeout_s=0.05) == 1
        assert await gate.wait_drained(timeout_s=0.05) == 1

    run(scenario())


def test_check_and_capture_are_atomic_under_concurrent_commits() -> None:
    """Many requests race many version flips; every admitted request satisfied its
    constraint with exactly the version it captured."""

    async def scenario() -> None:
        gate = AdmissionGate(0, wait_s=5)
        admitted: list[tuple[VersionConstraint, int]] = []

        async def commits() -> None:
            for version in range(1, 50):
                await gate.close()
                await asyncio.sleep(0)
                await gate.reopen(version)
                await asyncio.sleep(0)

        async def request(i: int) -> None:
            constraint = (
                VersionConstraint(exact_version=i % 50)
                if i % 2
                else VersionConstraint(min_version=i % 50)
            )
            try:
                async with gate.admitted(constraint) as admission:
                    admitted.append((constraint, admission.version))
                    await asyncio.sleep(0)
            except VersionNotReady:
                pass

        await asyncio.gather(commits(), *(request(i) for i in range(400)))
        assert admitted, "no request was admitted at all"
        assert all(c.satisfied_by(v) for c, v in admitted)
        assert gate.in_flight == 0

    run(scenario())
