"""A version published while the control plane is down, or never announced, is not lost:
the control plane adopts the store's pointer at start and every few seconds, and the
Publisher keeps trying to announce what it queued when it is closed.

Real `tether controlplane serve` processes on SQLite and a folder store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from launcher.processes import ManagedProcess, wait_until
from tests.controlplane.conftest import ADMIN, Api, publish, start_controlplane

HEADERS = {"Authorization": f"Bearer {ADMIN}"}
DEADLINE_S = 30.0


def latest(cp: ManagedProcess, run_id: str) -> int | None:
    reply = httpx.get(f"{cp.url}/v1/runs/{run_id}", headers=HEADERS, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["latest_version"]


def create_run(cp: ManagedProcess, run_id: str) -> None:
    reply = httpx.post(f"{cp.url}/v1/runs", json={"run_id": run_id}, headers=HEADERS, timeout=10)
    assert reply.status_code == 201, reply.text


def test_a_version_published_while_the_control_plane_was_down_is_adopted_at_start(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    db = f"sqlite:///{tmp_path / 'cp.db'}"
    store = tmp_path / "store"
    store.mkdir()
    slow = {"TETHER_STORE_SYNC_S": "3600"}  # only the look at start can find it
    first = start_controlplane(db, store, tmp_path / "cp1.log", **slow)
    processes.append(first)
    create_run(first, "offline")
    publish(store, "offline", 1)
    reply = httpx.post(
        f"{first.url}/v1/runs/offline/versions", json={"version": 1}, headers=HEADERS, timeout=10
    )
    assert reply.status_code == 201, reply.text
    first.stop()

    publish(store, "offline", 2)  # the trainer publishes; nobody hears about it
    second = start_controlplane(db, store, tmp_path / "cp2.log", **slow)
    processes.append(second)
    wait_until(lambda: latest(second, "offline") == 2, DEADLINE_S, "the pointer's v2 adopted")
    versions = httpx.get(f"{second.url}/v1/runs/offline/versions", headers=HEADERS).json()
    assert [v["version"] for v in versions["versions"]] == [1, 2]


def test_a_pointer_moved_without_a_notification_is_adopted_while_running(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    cp = start_controlplane(
        f"sqlite:///{tmp_path / 'cp.db'}", store, tmp_path / "cp.log", TETHER_STORE_SYNC_S="0.2"
    )
    processes.append(cp)
    create_run(cp, "silent")
    publish(store, "silent", 4)
    wait_until(lambda: latest(cp, "silent") == 4, DEADLINE_S, "the pointer's v4 adopted")
    # A long-poll for newer versions is woken by an adopted version too.
    answer: dict[str, list[int]] = {}

    def hold() -> None:
        reply = httpx.get(
            f"{cp.url}/v1/runs/silent/versions/wait",
            params={"after": 4, "timeout": 25},
            headers=HEADERS,
            timeout=40,
        )
        answer["versions"] = [v["version"] for v in reply.json()["versions"]]

    waiter = threading.Thread(target=hold)
    waiter.start()
    publish(store, "silent", 5)
    waiter.join(40)
    assert answer["versions"] == [5]


def test_publisher_close_delivers_a_queued_notification_once_the_control_plane_is_back(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    import torch

    from trainer_client.publisher import Publisher

    db = f"sqlite:///{tmp_path / 'cp.db'}"
    store = tmp_path / "store"
    store.mkdir()
    # The control plane never looks at the pointer by itself here: only the Publisher's
    # delivery can make it learn v1.
    quiet = {"TETHER_STORE_SYNC_S": "3600"}
    first = start_controlplane(db, store, tmp_path / "cp1.log", **quiet)
    processes.append(first)
    port = int((first.url or "").rsplit(":", 1)[1])
    weights = {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}
    publisher = Publisher(str(store), "queued", first.url, ADMIN, codec="full", progress=False)
    publisher.claim(0, weights)
    assert latest(first, "queued") == 0
    first.stop()

    report = publisher.publish({"w": torch.ones(4, 4, dtype=torch.bfloat16)}, version=1)
    assert not report.notified and publisher.notifier is not None and publisher.notifier.pending
    closing = threading.Thread(target=publisher.close, kwargs={"deliver_within_s": 120.0})
    closing.start()
    second = start_controlplane(db, store, tmp_path / "cp2.log", port=port, **quiet)
    processes.append(second)
    closing.join(150)
    assert not closing.is_alive()
    assert publisher.notifier.pending == []
    assert latest(second, "queued") == 1


def test_a_version_recorded_by_the_sync_and_the_notification_at_once_is_recorded_once(
    make_api: Callable[..., Api], db_url: str
) -> None:
    # The store sync and the trainer's notification (or two replicas) insert the same
    # version row at the same moment: the loser of the race must answer, not fail.
    api = make_api(db_url)
    api.create_run("race")
    runs = api.client.app.state.cp.runs
    callers = 6
    for version in range(1, 6):
        publish(api.store_root, "race", version)
        start = threading.Barrier(callers)
        answers: list[int] = []
        failures: list[BaseException] = []

        def record(
            version: int = version,
            start: threading.Barrier = start,
            answers: list[int] = answers,
            failures: list[BaseException] = failures,
        ) -> None:
            start.wait()
            try:
                answers.append(runs.record_version("race", version, None, version).version)
            except BaseException as exc:  # collected: the assertion below names it
                failures.append(exc)

        threads = [threading.Thread(target=record) for _ in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures
        assert answers == [version] * callers
    assert [v.version for v in runs.versions("race")] == [1, 2, 3, 4, 5]
