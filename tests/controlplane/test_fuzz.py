"""Property-based fuzz of the OpenAPI schema (schemathesis): no input makes a 5xx."""

from __future__ import annotations

from pathlib import Path

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck

from launcher.processes import ManagedProcess
from tests.controlplane.conftest import ADMIN, publish, start_controlplane

EXAMPLES_PER_OPERATION = 12


@pytest.mark.slow
def test_no_generated_request_makes_the_server_fail(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    cp = start_controlplane(
        f"sqlite:///{tmp_path / 'cp.db'}",
        store,
        tmp_path / "cp.log",
        TETHER_MAX_LONG_POLL_S="0.1",
        TETHER_MAX_BODY_BYTES="65536",
    )
    processes.append(cp)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    schema = schemathesis.openapi.from_url(f"{cp.url}/openapi.json")
    publish(store, "fuzz", 1)
    failures: list[str] = []
    calls: list[int] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20

    def fuzz(operation) -> None:  # type: ignore[no-untyped-def]
        @hypothesis.settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[hypothesis.Phase.generate],
        )
        @hypothesis.given(case=operation.as_strategy())
        def exercise(case) -> None:  # type: ignore[no-untyped-def]
            # A 5xx is the failure looked for; long polls are capped at 0.1 s. 10 s timed
            # out once with two test suites sharing two cores: a slow answer is not one.
            response = case.call(base_url=cp.url, headers=headers, timeout=120)
            calls.append(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{operation.label}: {response.status_code} {response.text[:300]}")

        exercise()

    for operation in operations:
        fuzz(operation)
    assert failures == []
    assert len(calls) >= 5 * len(operations), "the fuzz really sent requests"
    assert any(400 <= status < 500 for status in calls), "bad input was generated and refused"
