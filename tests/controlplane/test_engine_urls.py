"""Engine URLs: checked when an engine registers, and a URL the router still cannot use
(a row written before the check, a typo in a database) is that engine's failure — the
request moves on to the next eligible engine and never becomes a 500."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.processes import ManagedProcess
from tests.controlplane.conftest import Api, start_standin
from wire import EngineRegister, Precision, SyncState


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:notaport",
        "http://127.0.0.1:70000",
        "http://127.0.0.1:0",
        "http://:8000",
        "ftp://127.0.0.1:8000",
        "http://user:secret@127.0.0.1:8000",
        "http://127.0.0.1:8000/?x=1",
    ],
)
def test_an_engine_url_the_router_cannot_use_is_refused_at_registration(api: Api, url: str) -> None:
    api.create_run("u")
    reply = api.call(
        "POST", "/v1/engines", "engine", json={"url": url, "run_id": "u", "precision": "bf16"}
    )
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == "body.url"


def test_a_broken_engine_url_in_the_fleet_never_turns_into_a_500(
    api: Api, tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    engine = start_standin(1, tmp_path / "engine.log")
    processes.append(engine)
    api.create_run("u")
    api.publish("u", 1)
    api.register("u", 1, url=engine.url)
    cp = api.client.app.state.cp
    for bad in ("http://127.0.0.1:notaport", "http://127.0.0.1:99999"):
        # As a row from before registration checked URLs would be: straight into the registry.
        row = EngineRegister.model_construct(
            url=bad, run_id="u", precision=Precision.BF16, accelerator="cpu", capacity=1000,
            labels={}, applied_version=1, sync_state=SyncState.READY,
        )  # fmt: skip
        cp.registry.register(row, None)
    api.settle()
    assert len(cp.fleet.snapshot.engines) == 3

    statuses = [
        api.call("POST", "/v1/generate", "client", json={"text": f"r{i}"}).status_code
        for i in range(30)
    ]
    assert statuses == [200] * 30
