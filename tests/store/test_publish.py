"""The publish protocol: write, verify, then CAS; races, crashes and immutability."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from store.codecs import encode_version
from store.errors import AlreadyExists, PointerConflict, PointerRewind
from store.manifest import INDEX_FILENAME
from store.store import Store
from store.synthetic import random_checkpoint
from store.tensors import RawTensor
from store.types import VersionRef
from tests.store.chain import publish_chain, race, same_tensors

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0


def full_files(seed: int, version: int, shard_bytes: int = 16_384) -> dict[str, bytes]:
    return encode_version(
        random_checkpoint(seed=seed),
        None,
        version=version,
        base_version=None,
        codec="full",
        shard_bytes=shard_bytes,
    )


def test_publish_writes_verifies_then_moves_the_pointer(store: Store) -> None:
    store.create_run("run-a")
    files = full_files(seed=0, version=0)
    receipt = store.publish(VersionRef("run-a", 0), files)
    assert receipt.previous is None
    assert receipt.bytes_written == sum(len(data) for data in files.values())
    assert min(receipt.write_s, receipt.verify_s, receipt.cas_s) >= 0
    assert store.read_pointer("run-a") == VersionRef("run-a", 0)
    second = store.publish(VersionRef("run-a", 1), full_files(seed=1, version=1))
    assert second.previous == VersionRef("run-a", 0)
    assert store.list_versions("run-a") == [0, 1]


def test_a_backwards_version_is_refused_before_anything_is_written(store: Store) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 5), full_files(seed=0, version=5))
    with pytest.raises(PointerRewind, match="only move forward"):
        store.publish(VersionRef("run-a", 3), full_files(seed=1, version=3))
    assert [info.ref.version for info in store.version_infos("run-a")] == [5]


def test_a_stale_expected_pointer_is_refused_before_anything_is_written(store: Store) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 0), full_files(seed=0, version=0))
    store.publish(VersionRef("run-a", 1), full_files(seed=1, version=1))
    with pytest.raises(PointerConflict):
        store.publish(
            VersionRef("run-a", 2), full_files(seed=2, version=2), expected=VersionRef("run-a", 0)
        )
    assert store.list_versions("run-a") == [0, 1]


def test_a_written_version_cannot_be_replaced_before_the_pointer_moves(store: Store) -> None:
    store.create_run("run-a")
    files = full_files(seed=0, version=0)
    store.write_version(VersionRef("run-a", 0), files)
    with pytest.raises(AlreadyExists, match="immutable"):
        store.publish(VersionRef("run-a", 0), full_files(seed=99, version=0, shard_bytes=8_192))
    assert store.read_pointer("run-a") is None
    opened = store.open_version(VersionRef("run-a", 0))
    assert {name: opened[name] for name in opened} == files


def test_publishing_identical_bytes_again_is_idempotent_until_the_pointer_moves(
    store: Store,
) -> None:
    store.create_run("run-a")
    files = full_files(seed=0, version=0)
    store.write_version(VersionRef("run-a", 0), files)
    store.publish(VersionRef("run-a", 0), files)
    with pytest.raises(PointerRewind):
        store.publish(VersionRef("run-a", 0), files)
    assert store.read_pointer("run-a") == VersionRef("run-a", 0)


def test_threads_racing_to_publish_the_same_version_exactly_one_wins(store: Store) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 0), full_files(seed=0, version=0))
    seeds = [11, 12, 13, 14, 15]
    payloads = {seed: full_files(seed=seed, version=1) for seed in seeds}
    outcomes = race(
        [
            lambda seed=seed: store.publish(
                VersionRef("run-a", 1), payloads[seed], expected=VersionRef("run-a", 0)
            )
            for seed in seeds
        ]
    )
    assert sorted(outcomes) == ["PointerConflict"] * (len(seeds) - 1) + ["won"]
    winner = seeds[outcomes.index("won")]
    assert store.read_pointer("run-a") == VersionRef("run-a", 1)
    # The version holds the winner's bytes only, never a mix of racers.
    assert same_tensors(store.materialize("run-a", 1), random_checkpoint(seed=winner))


def test_threads_publishing_identical_bytes_race_at_the_pointer(store: Store) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 0), full_files(seed=0, version=0))
    files = full_files(seed=1, version=1)

    def publish() -> None:
        store.publish(VersionRef("run-a", 1), files, expected=VersionRef("run-a", 0))

    outcomes = race([publish, publish])
    assert sorted(outcomes) == ["PointerConflict", "won"]


def test_the_pointer_never_names_bytes_that_are_not_all_there(store: Store) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 0), full_files(seed=0, version=0))
    done = threading.Event()
    seen: list[tuple[int, bool]] = []

    def watch() -> None:
        while not done.is_set():
            ref = store.read_pointer("run-a")
            if ref is not None:
                files = store.open_version(ref)  # raises if anything is missing
                complete = all(len(files[name]) == files.sizes[name] for name in files)
                seen.append((ref.version, complete))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for version in range(1, 6):
            store.publish(VersionRef("run-a", version), full_files(seed=version, version=version))
    finally:
        done.set()
        watcher.join(timeout=DEADLINE_S)
    assert seen and all(complete for _, complete in seen)
    assert [v for v, _ in seen] == sorted(v for v, _ in seen)  # forward only


# ---- separate processes --------------------------------------------------------------

PROCESS_BACKENDS = ["file", pytest.param("s3", marks=pytest.mark.s3)]


class Child:
    """A publisher process and its stdout lines, read with deadlines."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.store.publisher_process", json.dumps(spec)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str) -> str:
        line = self.lines.get(timeout=DEADLINE_S)
        assert line.startswith(prefix), line
        return line

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def finish(self) -> int:
        return self.process.wait(timeout=DEADLINE_S)


def _spec(store_options: tuple[str, dict[str, Any]], **fields: Any) -> dict[str, Any]:
    url, options = store_options
    return {"url": url, "options": options, "run_id": "run-a", **fields}


@pytest.mark.parametrize("backend", PROCESS_BACKENDS, indirect=True)
def test_processes_racing_to_publish_the_same_version_exactly_one_wins(
    store: Store, store_options: tuple[str, dict[str, Any]]
) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 0), full_files(seed=0, version=0))
    children = {
        seed: Child(_spec(store_options, version=1, seed=seed, expected=0)) for seed in (21, 22)
    }
    for child in children.values():
        child.expect("ready")
    for child in children.values():
        child.send("go")
    codes = {seed: child.finish() for seed, child in children.items()}
    assert sorted(codes.values()) == [0, 3]  # one "won", one "conflict"
    winner = next(seed for seed, code in codes.items() if code == 0)
    assert store.read_pointer("run-a") == VersionRef("run-a", 1)
    assert same_tensors(store.materialize("run-a", 1), random_checkpoint(seed=winner))


@pytest.mark.parametrize("backend", PROCESS_BACKENDS, indirect=True)
def test_a_publisher_killed_mid_upload_leaves_the_pointer_and_the_next_publish_succeeds(
    store: Store, store_options: tuple[str, dict[str, Any]]
) -> None:
    store.create_run("run-a")
    store.publish(VersionRef("run-a", 0), full_files(seed=0, version=0))
    files = full_files(seed=1, version=1)
    assert len(files) >= 4
    child = Child(_spec(store_options, version=1, seed=1, expected=0, pause_after=3))
    child.expect("paused")  # the claim and two shards are written; the rest never will be
    os.kill(child.process.pid, signal.SIGKILL)
    assert child.finish() == -signal.SIGKILL
    assert store.read_pointer("run-a") == VersionRef("run-a", 0)
    assert store.list_versions("run-a") == [0]
    leftovers = store.version_infos("run-a")[-1]
    assert leftovers.ref.version == 1 and not leftovers.complete
    assert INDEX_FILENAME not in leftovers.sizes
    # Other bytes cannot take the number the dead publisher claimed...
    with pytest.raises(PointerConflict, match="another publisher claimed"):
        store.publish(VersionRef("run-a", 1), full_files(seed=7, version=1))
    # ...but the same publisher, restarted with the same bytes, finishes the version.
    store.publish(VersionRef("run-a", 1), files)
    assert store.read_pointer("run-a") == VersionRef("run-a", 1)
    assert same_tensors(store.materialize("run-a", 1), random_checkpoint(seed=1))
    store.publish(VersionRef("run-a", 2), full_files(seed=2, version=2))
    assert store.list_versions("run-a") == [0, 1, 2]


def test_published_chains_reconstruct_bit_for_bit(store: Store) -> None:
    history = publish_chain(store, "run-a", "FDDFD", codec="xor")
    for version, tensors in history.items():
        result: dict[str, RawTensor] = store.materialize("run-a", version)
        assert same_tensors(result, tensors)


def test_receipt_timings_cover_the_publish(store: Store) -> None:
    store.create_run("run-a")
    started = time.perf_counter()
    receipt = store.publish(VersionRef("run-a", 0), full_files(seed=0, version=0))
    elapsed = time.perf_counter() - started
    assert receipt.write_s + receipt.verify_s + receipt.cas_s <= elapsed
