"""The Publisher: trainer weights in, verified versions out, on a folder store and real S3."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from store.anchor import AnchorPolicy
from store.errors import PointerRewind, TensorMismatch
from store.store import Store
from store.torch_bridge import to_torch
from store.types import VersionKind, VersionRef
from tests.fixtures.seaweed import S3Server, seaweed_s3  # noqa: F401  (a fixture)
from trainer_client.notifier import ControlPlaneRefused
from trainer_client.publisher import Publisher

RUN = "pub-run"


def master_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """FP32 master weights of a small model, with one integer buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(96, 64, generator=g) * 0.02,
        "layers.0.mlp.weight": torch.randn(128, 64, generator=g) * 0.02,
        "layers.0.norm.weight": torch.ones(64),
        "lm_head.weight": torch.randn(96, 64, generator=g) * 0.02,
        "position_ids": torch.arange(32),
    }


def train_a_little(weights: dict[str, torch.Tensor], rows: int = 4) -> None:
    """An update touching a few rows of one matrix, like a sparse RL step."""
    weights["lm_head.weight"][:rows] += 0.01


def as_bf16(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}


def assert_store_holds(store: Store, version: int, expected: dict[str, torch.Tensor]) -> None:
    tensors = store.materialize(RUN, version)
    assert set(tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(to_torch(tensors[name]), tensor), name


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return str(tmp_path / "store"), {}
    server: S3Server = request.getfixturevalue("seaweed_s3")
    return server.url(), dict(server.storage_options)


@pytest.fixture
def publisher(store_url: tuple[str, dict[str, Any]]) -> Iterator[Publisher]:
    url, options = store_url
    with Publisher(url, RUN, storage_options=options, progress=False) as pub:
        yield pub


def test_claim_publishes_the_boot_weights_as_a_full_version_and_sets_the_pointer(
    publisher: Publisher,
) -> None:
    weights = master_weights()
    report = publisher.claim(0, weights)
    assert report is not None and report.version == 0 and report.kind is VersionKind.FULL
    assert publisher.store.read_pointer(RUN) == VersionRef(RUN, 0)
    assert publisher.store.read_run(RUN).canonical_dtype == "BF16"
    assert_store_holds(publisher.store, 0, as_bf16(weights))


def test_each_publish_is_a_small_delta_that_rebuilds_the_bf16_cast_of_the_master_weights(
    publisher: Publisher,
) -> None:
    weights = master_weights()
    publisher.claim(0, weights)
    for version in (1, 2, 3):
        train_a_little(weights)
        report = publisher.publish(weights)
        assert (report.version, report.kind, report.base_version) == (
            version,
            VersionKind.DELTA,
            version - 1,
        )
        assert report.changed_tensors == 1
        assert 0 < report.ratio_to_full < 0.2
        assert report.bytes == sum(publisher.store.version_infos(RUN)[-1].version_files.values())
    assert publisher.store.read_pointer(RUN) == VersionRef(RUN, 3)
    assert_store_holds(publisher.store, 3, as_bf16(weights))


def test_the_trainer_changing_its_weights_later_does_not_change_the_next_delta_base(
    tmp_path: Path,
) -> None:
    weights = master_weights()
    with Publisher(str(tmp_path), RUN, progress=False) as publisher:
        publisher.claim(0, as_bf16(weights))
        train_a_little(weights)
        publisher.publish(weights)
        weights["embed.weight"][0] += 1.0  # in place, after publishing
        train_a_little(weights)
        publisher.publish(weights)
        assert_store_holds(publisher.store, 2, as_bf16(weights))


def test_a_full_anchor_is_published_every_k_versions(tmp_path: Path) -> None:
    weights = master_weights()
    with Publisher(
        str(tmp_path), RUN, anchor_policy=AnchorPolicy(every=3), progress=False
    ) as publisher:
        kinds = [publisher.claim(0, weights).kind]  # type: ignore[union-attr]
        for _ in range(6):
            train_a_little(weights)
            kinds.append(publisher.publish(weights).kind)
    assert [k.value for k in kinds] == ["full", "delta", "delta", "full", "delta", "delta", "full"]


def test_a_delta_nearly_as_large_as_the_checkpoint_is_published_full(tmp_path: Path) -> None:
    with Publisher(str(tmp_path), RUN, progress=False) as publisher:
        publisher.claim(0, master_weights(seed=0))
        report = publisher.publish(master_weights(seed=1))  # every value changed
        assert report.kind is VersionKind.FULL and report.base_version is None
        assert_store_holds(publisher.store, 1, as_bf16(master_weights(seed=1)))


def _missing(w: dict[str, torch.Tensor]) -> None:
    del w["layers.0.mlp.weight"]


def _extra(w: dict[str, torch.Tensor]) -> None:
    w["layers.1.mlp.weight"] = torch.zeros(128, 64)


def _reshaped(w: dict[str, torch.Tensor]) -> None:
    w["lm_head.weight"] = torch.zeros(64, 96)


def _retyped(w: dict[str, torch.Tensor]) -> None:
    w["position_ids"] = w["position_ids"].to(torch.int32)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (_missing, "missing 1 tensor(s): layers.0.mlp.weight"),
        (_extra, "unexpected 1 tensor(s): layers.1.mlp.weight"),
        (_reshaped, "lm_head.weight: BF16[96, 64] -> BF16[64, 96]"),
        (_retyped, "position_ids: I64[32] -> I32[32]"),
    ],
)
def test_weights_that_do_not_match_the_run_publish_nothing(
    publisher: Publisher, damage: Any, words: str
) -> None:
    weights = master_weights()
    publisher.claim(0, weights)
    train_a_little(weights)
    publisher.publish(weights)
    listing = publisher.store.list_versions(RUN)
    bad = dict(weights)
    damage(bad)
    with pytest.raises(TensorMismatch, match="nothing was published") as caught:
        publisher.publish(bad)
    assert words in str(caught.value)
    assert publisher.store.read_pointer(RUN) == VersionRef(RUN, 1)
    assert publisher.store.list_versions(RUN) == listing
    # The publisher is still usable: the next good publish is v2.
    train_a_little(weights)
    assert publisher.publish(weights).version == 2


@pytest.mark.parametrize("version", [0, 1])
def test_a_version_that_is_not_newer_publishes_nothing(publisher: Publisher, version: int) -> None:
    weights = master_weights()
    publisher.claim(0, weights)
    train_a_little(weights)
    publisher.publish(weights)
    listing = [(i.ref.version, i.sizes) for i in publisher.store.version_infos(RUN)]
    train_a_little(weights)
    with pytest.raises(PointerRewind, match=r"not newer .* publish v2 or later"):
        publisher.publish(weights, version=version)
    assert publisher.store.read_pointer(RUN) == VersionRef(RUN, 1)
    assert [(i.ref.version, i.sizes) for i in publisher.store.version_infos(RUN)] == listing


def test_a_restarted_publisher_resumes_from_the_pointer_with_deltas(tmp_path: Path) -> None:
    weights = master_weights()
    with Publisher(str(tmp_path), RUN, progress=False) as first:
        first.claim(0, weights)
        train_a_little(weights)
        first.publish(weights)
    with Publisher(str(tmp_path), RUN, progress=False) as second:
        assert second.claim(0, weights) is None  # the run has versions: nothing republished
        assert second.version == 1
        train_a_little(weights)
        report = second.publish(weights)
        assert (report.version, report.kind, report.base_version) == (2, VersionKind.DELTA, 1)
        assert_store_holds(second.store, 2, as_bf16(weights))


def test_a_hugging_face_folder_publishes_like_its_state_dict(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = master_weights()
    folder = tmp_path / "hf"
    folder.mkdir()
    bf16 = as_bf16(weights)
    first = folder / "model-00001-of-00002.safetensors"
    second = folder / "model-00002-of-00002.safetensors"
    save_file({k: bf16[k] for k in list(bf16)[:2]}, str(first))
    save_file({k: bf16[k] for k in list(bf16)[2:]}, str(second))
    with Publisher(str(tmp_path / "store"), RUN, progress=False) as publisher:
        publisher.claim(0, folder)
        assert publisher.store.read_run(RUN).base_checkpoint == str(folder.resolve())
        train_a_little(weights)
        save_file({k: as_bf16(weights)[k] for k in list(bf16)[2:]}, str(second))
        assert publisher.publish(folder).kind is VersionKind.DELTA
        assert_store_holds(publisher.store, 1, as_bf16(weights))


def test_the_control_plane_hears_of_every_version_even_after_being_down(tmp_path: Path) -> None:
    import httpx

    from demo.local_fleet import start_controlplane
    from launcher.processes import ProcessGroup

    store = str(tmp_path / "store")
    db = f"sqlite:///{tmp_path / 'cp.db'}"
    run_id = f"cp-{uuid.uuid4().hex[:8]}"
    weights = master_weights()
    with ProcessGroup(tmp_path / "logs") as group:
        cp = start_controlplane(group, db, store)
        trainer = cp.tokens["trainer"]
        with (
            Publisher(store, run_id, cp.url, cp.tokens["client"], progress=False) as wrong,
            pytest.raises(ControlPlaneRefused, match="refused to create run"),
        ):
            wrong.claim(0, weights)  # a client token may not create runs
        with Publisher(store, run_id, cp.url, trainer, progress=False) as publisher:
            assert publisher.claim(0, weights).notified  # type: ignore[union-attr]
            train_a_little(weights)
            assert publisher.publish(weights).notified
            cp.process.stop()
            train_a_little(weights)
            down = publisher.publish(weights)
            assert not down.notified  # the version is published all the same
            assert Store(store).read_pointer(run_id) == VersionRef(run_id, 2)
            port = int((cp.url or "").rsplit(":", 1)[1])
            restarted = group.start(
                "controlplane-again",
                [cp.process.process.args[0], "controlplane", "serve", "--db", db,
                 "--store", store, "--port", str(port), "--log-level", "warning"],
                env={"TETHER_ADMIN_TOKEN": cp.tokens["admin"]},
                url=cp.url,
            )  # fmt: skip
            restarted.wait_http("/readyz", deadline_s=60.0)
            train_a_little(weights)
            assert publisher.publish(weights).notified  # delivers v2, then v3
        listed = httpx.get(
            f"{cp.url}/v1/runs/{run_id}/versions",
            headers={"Authorization": f"Bearer {trainer}"},
            timeout=10.0,
        ).json()["versions"]
    assert [v["version"] for v in listed] == [0, 1, 2, 3]
