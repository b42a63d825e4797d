"""Fixtures for the store tests: a fresh store on each backend, small checkpoints.

`store_options` is parametrized over memory://, file:// and a real S3 server (SeaweedFS, started
once per session by `tests.fixtures.seaweed`); each test gets its own empty root.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from store.store import Store
from store.synthetic import random_checkpoint
from store.tensors import RawTensor
from tests.fixtures.seaweed import S3Server, seaweed_s3  # noqa: F401  (a fixture)

BACKENDS = ["memory", "file", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_options(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, dict[str, Any]]:
    """(url, storage_options) of an empty store root on the test's backend."""
    if backend == "memory":
        return f"memory://{uuid.uuid4().hex}", {}
    if backend == "file":
        return str(tmp_path / "store"), {}
    server: S3Server = request.getfixturevalue("seaweed_s3")
    return server.url(), dict(server.storage_options)


@pytest.fixture
def store(store_options: tuple[str, dict[str, Any]]) -> Store:
    url, options = store_options
    return Store(url, storage_options=options)


@pytest.fixture
def checkpoint() -> dict[str, RawTensor]:
    return random_checkpoint(seed=1)
