"""Reconciler failure boundaries with real processes: a commit the engine refuses makes the
replica terminal (the agent deregisters and exits non-zero); it is never retried."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_agent.agent import EXIT_UNRECOVERABLE
from tests.engine_agent.conftest import (
    VersionChain,
    launch_agent,
    start_controlplane,
    wait_agent,
    wait_applied,
)
from tests.fixtures.processes import stop_all, wait_until
from tests.fixtures.reference_engine import TinyCheckpoints, start_reference_engine

RUN = "refused-run"


def test_a_commit_the_engine_refuses_is_terminal_and_deregisters(
    tiny: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from reference_engine.tiny_model import TinyModelSpec, init_tiny_model

    root: Path = tmp_path_factory.mktemp("refused")
    # The run publishes a model of another shape than the one the engine serves.
    other = init_tiny_model(root / "narrow", TinyModelSpec(hidden=64, heads=2, head_dim=32))
    engine = start_reference_engine(tiny.bf16, root / "engine.log")
    cp = start_controlplane(root)
    try:
        chain = VersionChain(root / "store", RUN, other)
        assert cp.call("POST", "/v1/runs", "trainer", json={"run_id": RUN}).status_code == 201
        cp.notify(RUN, 0)
        agent = launch_agent(
            "agent", engine.url, "bf16", root, store_root=chain.store_root, run_id=RUN,
            boot_model=other, control_plane=cp,
        )  # fmt: skip
        wait_agent(agent)
        wait_applied(agent, 0)
        wait_until(lambda: cp.engine(RUN, agent.url), 30, "the agent to register")
        cp.notify(RUN, chain.publish())
        assert agent.wait_exit(60) == EXIT_UNRECOVERABLE
        assert "UnrecoverableEngineError" in agent.log_tail()
        assert cp.engine(RUN, agent.url) is None
    finally:
        stop_all([cp.process, engine])
