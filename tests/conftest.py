"""Fixtures shared by several test folders: the tiny model's checkpoints and one BF16
reference engine process, built once per session (the engine-agent and reference-engine
tests both use them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.reference_engine import (
    ReferenceEngineProcess,
    TinyCheckpoints,
    make_tiny_checkpoints,
    start_reference_engine,
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """The tiny model in BF16 (seed 0 and seed 1), FP8 and NVFP4."""
    return make_tiny_checkpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def bf16_engine(
    tiny: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ReferenceEngineProcess]:
    """A BF16 reference engine that tests must leave unpaused and on its boot weights."""
    engine = start_reference_engine(tiny.bf16, tmp_path_factory.mktemp("logs") / "bf16.log")
    yield engine
    engine.stop()
