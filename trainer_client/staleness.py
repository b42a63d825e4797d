"""Staleness of rollout groups and the buffer that keeps a trainer's batches fresh enough.

A group (the rollouts of one prompt) is as old as its oldest token: its staleness is the
trainer's current version minus the oldest policy version that produced any of its tokens
(`weight_version_start` of each rollout is that bound). Staleness only grows as the trainer
publishes, so a group that is too stale now can never become usable: the buffer drops it
and counts it, rather than training on it.

`StalenessBuffer` is filled by rollout tasks (threads or asyncio tasks) and drained by the
trainer loop; one lock guards its state, a condition wakes a waiting trainer. It reports
queue size, the average / max staleness of the groups it handed out and of those still
queued, and how many groups it dropped.

This module must never call an engine, publish a version or look inside a group's payload:
a group is opaque apart from the versions it is put with.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from store.types import validate_version

T = TypeVar("T")


def oldest_version(versions: Iterable[int]) -> int:
    """The oldest policy version among a group's tokens (the min of their versions)."""
    found = [validate_version(v, "token version") for v in versions]
    if not found:
        raise ValueError(
            "a group needs at least one token version to measure its staleness; pass each "
            "rollout's weight_version_start"
        )
    return min(found)


def group_staleness(trainer_version: int, versions: Iterable[int]) -> int:
    """trainer version − the oldest version of any token of the group (0 when current)."""
    return validate_version(trainer_version, "trainer version") - oldest_version(versions)


@dataclass(frozen=True)
class StalenessReport:
    """What the buffer did since the last window reset, and what it holds now.

    `avg_staleness`/`max_staleness` cover the groups handed to the trainer in the window;
    `buffer_avg_staleness`/`buffer_max_staleness` the groups still queued, measured at the
    latest trainer version the buffer has seen. `dropped_stale` counts the window,
    `dropped_stale_total` the buffer's lifetime.
    """

    queue_size: int
    consumed: int
    avg_staleness: float
    max_staleness: int
    buffer_avg_staleness: float
    buffer_max_staleness: int
    dropped_stale: int
    dropped_stale_total: int

    def as_dict(self) -> dict[str, float]:
        """Flat metric names for a logger."""
        return {name: float(getattr(self, name)) for name in self.__dataclass_fields__}


@dataclass
class _Entry(Generic[T]):
    group: T
    oldest: int


class StalenessBuffer(Generic[T]):
    """FIFO of rollout groups that drops any group staler than `max_staleness`.

    `max_staleness=None` keeps every group (staleness is still measured). `capacity`
    bounds the queue: `put` then waits for room (or times out), so producers cannot run
    ahead of the trainer without limit. Safe to share between threads and event loops:
    the `*_async` methods wait on a future that any state change resolves, so they never
    block the loop or hold a worker thread.
    """

    def __init__(self, max_staleness: int | None, capacity: int | None = None) -> None:
        if max_staleness is not None:
            validate_version(max_staleness, "max_staleness")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least 1 group (or None), got {capacity}")
        self.max_staleness = max_staleness
        self.capacity = capacity
        self._queue: deque[_Entry[T]] = deque()
        self._changed = threading.Condition(threading.Lock())
        self._trainer_version: int | None = None
        self._window_staleness: list[int] = []
        self._dropped_window = 0
        self._dropped_total = 0
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ----------------------------------------------------------------- producers

    def put(self, group: T, versions: Iterable[int], timeout: float | None = None) -> None:
        """Queue `group`, whose tokens were produced by `versions`.

        A group already too stale for the latest trainer version seen is dropped at once.
        With a capacity, waits up to `timeout` seconds for room, else raises `TimeoutError`.
        """
        entry = _Entry(group, oldest_version(versions))
        deadline = _deadline(timeout)
        with self._changed:
            while not self._try_put_locked(entry):
                self._changed.wait(_remaining(deadline, self._full_error(timeout)))

    async def put_async(
        self, group: T, versions: Iterable[int], timeout: float | None = None
    ) -> None:
        """`put` for asyncio producers: waits for room without blocking the event loop."""
        entry = _Entry(group, oldest_version(versions))
        deadline = _deadline(timeout)
        while True:
            with self._changed:
                if self._try_put_locked(entry):
                    return
                waiter = self._async_waiter_locked()
            await _await_waiter(waiter, _remaining(deadline, self._full_error(timeout)))

    # ----------------------------------------------------------------- the trainer

    def take(self, trainer_version: int, count: int, timeout: float | None = None) -> list[T]:
        """Return the `count` oldest-queued groups fresh enough for `trainer_version`.

        Drops (and counts) every queued group staler than `max_staleness` first, then waits
        up to `timeout` seconds until `count` fresh groups are queued; raises
        `TimeoutError` without taking any if they do not arrive.
        """
        _check_take(trainer_version, count)
        deadline = _deadline(timeout)
        with self._changed:
            while (taken := self._try_take_locked(trainer_version, count)) is None:
                error = self._short_error(trainer_version, count, timeout)
                self._changed.wait(_remaining(deadline, error))
            return taken

    async def take_async(
        self, trainer_version: int, count: int, timeout: float | None = None
    ) -> list[T]:
        """`take` for an asyncio trainer loop: waits without blocking the event loop."""
        _check_take(trainer_version, count)
        deadline = _deadline(timeout)
        while True:
            with self._changed:
                taken = self._try_take_locked(trainer_version, count)
                if taken is not None:
                    return taken
                error = self._short_error(trainer_version, count, timeout)
                waiter = self._async_waiter_locked()
            await _await_waiter(waiter, _remaining(deadline, error))

    def drop_stale(self, trainer_version: int) -> int:
        """Drop every queued group too stale for `trainer_version`; return how many."""
        validate_version(trainer_version, "trainer version")
        with self._changed:
            self._advance(trainer_version)
            return self._drop_stale_locked()

    def report(self, reset_window: bool = True) -> StalenessReport:
        """Current figures; by default starts a new reporting window (one per train step)."""
        with self._changed:
            consumed = self._window_staleness
            current = self._trainer_version
            queued = [] if current is None else [current - e.oldest for e in self._queue]
            report = StalenessReport(
                queue_size=len(self._queue),
                consumed=len(consumed),
                avg_staleness=sum(consumed) / len(consumed) if consumed else 0.0,
                max_staleness=max(consumed, default=0),
                buffer_avg_staleness=sum(queued) / len(queued) if queued else 0.0,
                buffer_max_staleness=max(queued, default=0),
                dropped_stale=self._dropped_window,
                dropped_stale_total=self._dropped_total,
            )
            if reset_window:
                self._window_staleness = []
                self._dropped_window = 0
            return report

    def __len__(self) -> int:
        with self._changed:
            return len(self._queue)

    # ----------------------------------------------------------------- internals

    def _try_put_locked(self, entry: _Entry[T]) -> bool:
        """Queue or drop `entry`; False when the queue is full (the caller waits)."""
        if self._is_stale(entry, self._trainer_version):
            self._record_drops(1)
            return True
        if self.capacity is not None and len(self._queue) >= self.capacity:
            return False
        self._queue.append(entry)
        self._notify_locked()
        return True

    def _try_take_locked(self, trainer_version: int, count: int) -> list[T] | None:
        """Pop `count` fresh groups, or None when fewer are queued (the caller waits)."""
        self._advance(trainer_version)
        self._drop_stale_locked()
        if len(self._queue) < count:
            return None
        taken = [self._queue.popleft() for _ in range(count)]
        self._window_staleness.extend(trainer_version - e.oldest for e in taken)
        self._notify_locked()
        return [e.group for e in taken]

    def _full_error(self, timeout: float | None) -> TimeoutError:
        return TimeoutError(
            f"staleness buffer full ({self.capacity} groups) for {timeout} s: the trainer is "
            "not consuming; raise capacity or slow the producers"
        )

    def _short_error(self, trainer_version: int, count: int, timeout: float | None) -> TimeoutError:
        return TimeoutError(
            f"only {len(self._queue)} of {count} fresh groups arrived within {timeout} s "
            f"at trainer version {trainer_version}"
        )

    def _async_waiter_locked(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._async_waiters.append((loop, future))
        return future

    def _notify_locked(self) -> None:
        """Wake every waiter, thread or coroutine; each re-checks its own condition."""
        self._changed.notify_all()
        for loop, future in self._async_waiters:
            loop.call_soon_threadsafe(_resolve, future)
        self._async_waiters.clear()

    def _advance(self, trainer_version: int) -> None:
        if self._trainer_version is None or trainer_version > self._trainer_version:
            self._trainer_version = trainer_version

    def _is_stale(self, entry: _Entry[T], trainer_version: int | None) -> bool:
        if self.max_staleness is None or trainer_version is None:
            return False
        return trainer_version - entry.oldest > self.max_staleness

    def _drop_stale_locked(self) -> int:
        kept = [e for e in self._queue if not self._is_stale(e, self._trainer_version)]
        dropped = len(self._queue) - len(kept)
        if dropped:
            self._queue = deque(kept)
            self._record_drops(dropped)
            self._notify_locked()
        return dropped

    def _record_drops(self, count: int) -> None:
        self._dropped_window += count
        self._dropped_total += count


def _check_take(trainer_version: int, count: int) -> None:
    validate_version(trainer_version, "trainer version")
    if count < 1:
        raise ValueError(f"count must be at least 1 group, got {count}")


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None, error: TimeoutError) -> float | None:
    """Seconds left before `deadline` (None: wait forever); raise `error` once it passed."""
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise error
    return remaining


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _await_waiter(future: asyncio.Future[None], remaining: float | None) -> None:
    # A timed-out wait just loops back to the caller's check, which raises past the deadline.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(future, remaining)
