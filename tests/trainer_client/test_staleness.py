"""Specification of group staleness and the StalenessBuffer (spec §10)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from store.errors import InvalidVersion
from trainer_client.staleness import StalenessBuffer, group_staleness, oldest_version


def test_group_staleness_is_trainer_version_minus_the_oldest_token_version():
    assert oldest_version([7, 5, 6]) == 5
    assert group_staleness(9, [7, 5, 6]) == 4
    assert group_staleness(5, [5]) == 0


def test_staleness_of_a_group_without_versions_or_with_bad_versions_is_refused():
    with pytest.raises(ValueError, match="at least one token version"):
        group_staleness(3, [])
    with pytest.raises(InvalidVersion):
        group_staleness(3, [-1])


def test_take_returns_fresh_groups_in_arrival_order_and_drops_stale_ones():
    buffer: StalenessBuffer[str] = StalenessBuffer(max_staleness=2)
    buffer.put("a", [3, 4])  # staleness 3 at version 6: dropped
    buffer.put("b", [4])  # staleness 2: kept
    buffer.put("c", [5, 6])
    buffer.put("d", [6])
    assert buffer.take(6, 2, timeout=0) == ["b", "c"]
    report = buffer.report()
    assert report.dropped_stale == 1
    assert report.consumed == 2
    assert report.avg_staleness == pytest.approx(1.5)
    assert report.max_staleness == 2
    assert report.queue_size == 1


def test_a_group_arriving_already_too_stale_is_dropped_on_put():
    buffer: StalenessBuffer[str] = StalenessBuffer(max_staleness=1)
    buffer.put("x", [10])
    assert buffer.take(10, 1) == ["x"]
    buffer.put("late", [8])
    assert len(buffer) == 0
    assert buffer.report().dropped_stale == 1


def test_without_a_limit_nothing_is_dropped_but_staleness_is_still_measured():
    buffer: StalenessBuffer[int] = StalenessBuffer(max_staleness=None)
    for i in range(3):
        buffer.put(i, [i])
    assert buffer.drop_stale(100) == 0
    assert buffer.take(100, 3) == [0, 1, 2]
    report = buffer.report()
    assert (report.max_staleness, report.avg_staleness) == (100, 99.0)


def test_report_windows_reset_but_lifetime_drop_count_does_not():
    buffer: StalenessBuffer[int] = StalenessBuffer(max_staleness=0)
    buffer.put(1, [1])
    buffer.put(2, [2])
    assert buffer.drop_stale(2) == 1
    first = buffer.report()
    assert (first.dropped_stale, first.dropped_stale_total) == (1, 1)
    assert (first.buffer_avg_staleness, first.buffer_max_staleness) == (0.0, 0)
    buffer.put(3, [3])
    assert buffer.drop_stale(4) == 2
    second = buffer.report(reset_window=False)
    assert (second.dropped_stale, second.dropped_stale_total) == (2, 3)
    assert buffer.report().as_dict()["dropped_stale"] == 2.0
    assert buffer.report().dropped_stale == 0


def test_buffered_staleness_is_measured_at_the_latest_trainer_version():
    buffer: StalenessBuffer[str] = StalenessBuffer(max_staleness=10)
    buffer.put("a", [1])
    buffer.put("b", [3])
    buffer.drop_stale(4)
    report = buffer.report()
    assert (report.buffer_avg_staleness, report.buffer_max_staleness) == (2.0, 3)


def test_take_times_out_without_consuming_anything():
    buffer: StalenessBuffer[str] = StalenessBuffer(max_staleness=1)
    buffer.put("only", [1])
    with pytest.raises(TimeoutError, match="only 1 of 2"):
        buffer.take(1, 2, timeout=0.05)
    assert len(buffer) == 1


def test_take_waits_for_producer_threads():
    buffer: StalenessBuffer[int] = StalenessBuffer(max_staleness=4)
    start = threading.Event()

    def produce(offset: int) -> None:
        start.wait()
        for i in range(25):
            buffer.put(offset + i, [7])

    threads = [threading.Thread(target=produce, args=(k * 100,)) for k in range(4)]
    for thread in threads:
        thread.start()
    start.set()
    got = [g for _ in range(10) for g in buffer.take(8, 10, timeout=10)]
    for thread in threads:
        thread.join()
    assert sorted(got) == sorted(k * 100 + i for k in range(4) for i in range(25))
    assert buffer.report().consumed == 100


def test_put_blocks_at_capacity_until_the_trainer_takes():
    buffer: StalenessBuffer[int] = StalenessBuffer(max_staleness=None, capacity=2)
    buffer.put(1, [0])
    buffer.put(2, [0])
    with pytest.raises(TimeoutError, match="full"):
        buffer.put(3, [0], timeout=0.05)
    done = threading.Event()

    def late_producer() -> None:
        buffer.put(3, [0], timeout=10)
        done.set()

    thread = threading.Thread(target=late_producer)
    thread.start()
    assert buffer.take(0, 1) == [1]
    assert done.wait(10)
    thread.join()
    assert buffer.take(0, 2) == [2, 3]


def test_asyncio_producers_feed_an_asyncio_trainer():
    async def main() -> list[int]:
        buffer: StalenessBuffer[int] = StalenessBuffer(max_staleness=1, capacity=4)

        async def rollout(i: int) -> None:
            await asyncio.sleep(0)
            await buffer.put_async(i, [5 if i % 2 else 3], timeout=10)

        producers = asyncio.gather(*(rollout(i) for i in range(40)))
        taken = []
        for _ in range(5):
            taken += await buffer.take_async(5, 4, timeout=10)
        await producers
        assert buffer.report().dropped_stale == 20
        return taken

    taken = asyncio.run(main())
    assert sorted(taken) == list(range(1, 40, 2))  # version-3 groups are 2 behind: dropped


def test_async_take_times_out_when_groups_do_not_arrive():
    async def main() -> None:
        buffer: StalenessBuffer[int] = StalenessBuffer(max_staleness=1)
        await buffer.put_async(1, [1])
        with pytest.raises(TimeoutError, match="only 1 of 2"):
            await buffer.take_async(1, 2, timeout=0.05)
        assert len(buffer) == 1

    asyncio.run(main())


def test_a_thread_producer_wakes_an_asyncio_trainer():
    async def main() -> list[int]:
        buffer: StalenessBuffer[int] = StalenessBuffer(max_staleness=0)
        waiting = asyncio.ensure_future(buffer.take_async(2, 2, timeout=10))
        await asyncio.sleep(0)  # let the trainer start waiting
        producer = threading.Thread(target=lambda: [buffer.put(i, [2]) for i in range(2)])
        producer.start()
        taken = await waiting
        producer.join()
        return taken

    assert asyncio.run(main()) == [0, 1]
