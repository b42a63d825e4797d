"""One group-commit batch of heartbeats, on SQLite and on PostgreSQL: each beat gets its
own engine's lease or None, exactly as if the beats had been written one by one."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from controlplane.db import migrate, open_engine, session_factory
from controlplane.registry import Registry
from controlplane.runs import Runs
from wire import EngineRegister, Heartbeat, RunCreate, SyncState


@pytest.fixture
def registry(db_url: str, tmp_path) -> Iterator[Registry]:  # type: ignore[no-untyped-def]
    migrate(db_url)
    engine = open_engine(db_url)
    sessions = session_factory(engine)
    Runs(sessions, str(tmp_path)).create(RunCreate(run_id="r"))
    found = Registry(sessions, lease_seconds=60.0)
    yield found
    found.close()
    engine.dispose()


def register(registry: Registry, n: int, owner: str | None = None) -> list[str]:
    body = {"run_id": "r", "precision": "bf16", "applied_version": 0, "sync_state": "ready"}
    return [
        registry.register(EngineRegister(url=f"http://10.0.0.{i}:8000", **body), owner)[0]
        for i in range(n)
    ]


def beat(**fields: object) -> Heartbeat:
    return Heartbeat.model_validate({"applied_version": 1, "sync_state": "ready", **fields})


def test_a_batch_answers_each_beat_and_none_for_unknown_or_lapsed_engines(
    registry: Registry,
) -> None:
    live, lapsed = register(registry, 2)
    registry.lease_seconds = -1.0
    registry.heartbeat_many([(lapsed, beat())])  # its lease now ends in the past
    registry.lease_seconds = 60.0

    answers = registry.heartbeat_many(
        [(live, beat(in_flight=1)), ("not-an-engine", beat()), (lapsed, beat()), (live, beat())]
    )

    assert answers[0] is not None and answers[0] > time.time() + 50
    assert answers[3] == answers[0], "a second beat of one engine in a batch is renewed too"
    assert answers[1] is None and answers[2] is None
    assert [e.engine_id for e in registry.rows()] == [live]


def test_a_batch_keeps_the_staging_clock_while_the_target_stays_the_same(
    registry: Registry,
) -> None:
    staging, idle = register(registry, 2)
    syncing = {"sync_state": "syncing", "staging_target": 4}
    registry.heartbeat_many([(staging, beat(staging_progress=0.1, **syncing)), (idle, beat())])
    started = registry.rows(staging)[0].staging_started_at

    registry.heartbeat_many([(idle, beat()), (staging, beat(staging_progress=0.6, **syncing))])

    row = registry.rows(staging)[0]
    assert started is not None and row.staging_started_at == started
    assert row.staging_progress == pytest.approx(0.6)
    assert row.sync_state == SyncState.SYNCING.value
    assert registry.rows(idle)[0].staging_started_at is None
    assert registry.rows(idle)[0].applied_version == 1


def test_in_a_batch_only_the_owners_beat_renews_its_engine(registry: Registry) -> None:
    (engine,) = register(registry, 1, owner="a" * 64)
    answers = registry.heartbeat_many(
        [(engine, beat(in_flight=7)), (engine, beat(in_flight=1))], ["b" * 64, "a" * 64]
    )

    assert answers[0] is None, "another token's beat renews nothing"
    assert answers[1] is not None, "the owner's beat in the same batch still renews"
    assert registry.rows(engine)[0].in_flight == 1
    assert registry.heartbeat_many([(engine, beat())], [None])[0] is not None, "admin may"
