"""The Publisher rides out transient store faults, and fails cleanly past its retry budget.

A real fault stands between the Publisher and a real S3 server (SeaweedFS): a loopback
proxy that resets PUT requests before the server sees them. The S3 client retries a reset
a few times on its own; past that the Publisher's own retries (with backoff) take over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from launcher.fault_proxy import ResettingProxy
from store.store import Store
from store.torch_bridge import to_torch
from store.types import VersionRef
from tests.fixtures.seaweed import S3Server, seaweed_s3  # noqa: F401  (a fixture)
from trainer_client.publisher import Publisher, UploadFailed

pytestmark = pytest.mark.s3

RUN = "retry-run"


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {"embed.weight": torch.randn(64, 32, generator=g), "norm.weight": torch.ones(32)}
    tensors["embed.weight"][:step] += 0.5
    return tensors


@dataclass
class FaultyStore:
    """A fresh prefix of the S3 server, reached by the Publisher through the resetting proxy
    and by the test directly (what readers really see)."""

    proxy: ResettingProxy
    server: S3Server
    url: str
    caplog: pytest.LogCaptureFixture

    def publisher(self, attempts: int) -> Publisher:
        options = {**self.server.storage_options, "endpoint_url": self.proxy.url}
        return Publisher(
            self.url, RUN, storage_options=options, upload_attempts=attempts, progress=False
        )

    def pointer(self) -> VersionRef | None:
        return self.direct().read_pointer(RUN)

    def direct(self) -> Store:
        return Store(self.url, storage_options=dict(self.server.storage_options))

    def retries_logged(self) -> list[str]:
        """The Publisher's "retry" warnings logged so far."""
        return [
            r.getMessage()
            for r in self.caplog.records
            if r.name == "trainer_client.publisher" and "retry" in r.getMessage()
        ]


@pytest.fixture
def faulty(seaweed_s3: S3Server, caplog: pytest.LogCaptureFixture) -> Iterator[FaultyStore]:  # noqa: F811
    caplog.set_level(logging.WARNING, logger="trainer_client.publisher")
    with ResettingProxy(seaweed_s3.endpoint_url) as proxy:
        yield FaultyStore(proxy, seaweed_s3, seaweed_s3.url(), caplog)


def test_a_publish_survives_connection_resets_by_retrying_the_upload(faulty: FaultyStore) -> None:
    with faulty.publisher(attempts=4) as publisher:
        publisher.claim(0, weights(0))
        # More resets in a row than the S3 client absorbs by itself: the Publisher must retry.
        faulty.proxy.reset_next_puts(4)
        report = publisher.publish(weights(3))
    assert faulty.proxy.resets == 4
    assert report.version == 1
    retries = faulty.retries_logged()
    assert len(retries) >= 1, "the Publisher never retried; the S3 client hid every reset"
    assert all("weight_v000001" in message for message in retries)
    assert faulty.pointer() == VersionRef(RUN, 1)
    rebuilt = faulty.direct().materialize(RUN, 1)
    assert torch.equal(to_torch(rebuilt["embed.weight"]), weights(3)["embed.weight"].bfloat16())


def test_a_publish_past_its_retry_budget_fails_clearly_and_leaves_the_pointer(
    faulty: FaultyStore,
) -> None:
    with faulty.publisher(attempts=2) as publisher:
        publisher.claim(0, weights(0))
        faulty.proxy.reset_next_puts(1_000_000)  # every PUT from now on
        reached_server = faulty.proxy.forwarded_puts
        with pytest.raises(UploadFailed, match="weight_v000001 failed after 2 attempts"):
            publisher.publish(weights(3))
        assert faulty.proxy.forwarded_puts == reached_server
        assert len(faulty.retries_logged()) == 1  # attempts - 1
        assert faulty.pointer() == VersionRef(RUN, 0)

        # Once the fault clears, the same Publisher publishes the same version.
        faulty.proxy.reset_next_puts(0)
        assert publisher.publish(weights(3)).version == 1
    assert faulty.pointer() == VersionRef(RUN, 1)
