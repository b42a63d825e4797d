"""The cycle collector of a long-running process: what it scans, and how often.

CPython's cycle collector holds the GIL for the whole of a collection, so every request in
flight waits for it. With CPython's default thresholds a full collection is considered
every 70,000 net container allocations and scans every tracked object. At 1,000 engines a
control plane holds about half a million tracked objects (its imports, the fleet
snapshot, a long-poll and a connection per engine), and on the 2-core bench VM a full
collection of them took 0.4–0.46 s, once every ~4 s, and found almost nothing (0–2,600
objects). Young collections of more than 5 ms added 7 s over the same five minutes. Every
heartbeat and wake-up in flight waited through them (docs/benchmarks.md, "The control
plane's garbage collector at 1,000 engines"). An engine agent holds ~0.3–0.4 M tracked
objects once booted, nearly all of them its imports (torch, transformers), and a full
collection of them held it 0.14 s during a catch-up, its proxy and heartbeats included.

`settle` runs once the process is booted. It freezes what exists then (imports,
settings, the first snapshot: never garbage, and now never scanned again; freezing moves
lists, so it costs nothing). A control plane also raises the thresholds (`spaced`) so
that the young generation is collected every `YOUNG` allocations and a full collection is
considered every `YOUNG * MIDDLE * FULL` (2 × 10^7, minutes apart at the bench's rates)
instead of every 70,000: its garbage is small objects. An agent keeps CPython's
thresholds: a cycle there may hold a tensor of gigabytes (a failed catch-up's traceback),
which should not wait minutes; it collects once before freezing (`collect_first`), so no
garbage of its boot is frozen with the rest. Garbage without cycles is freed by reference
counting as before, frozen or not. `PauseObserver` reports every collection's pause to a
callback (the `tether_gc_pause_seconds` and `tether_agent_gc_pause_seconds` histograms).
Never touches anything but the `gc` module's settings.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

YOUNG = 20_000  # net container allocations between young collections (CPython: 700)
MIDDLE = 100  # young collections per middle one (CPython: 10)
FULL = 10  # middle collections per full one considered (CPython: 10)


_lock = threading.Lock()
_holders = 0  # apps of this process that have settled (the tests build several)
_before: tuple[int, int, int] = (700, 10, 10)


def settle(*, spaced: bool = True, collect_first: bool = False) -> None:
    """Freeze the objects that exist now (after one full collection with `collect_first`)
    and, with `spaced`, space collections out. The first call of a process does it; later
    ones only count, until as many `unsettle` calls."""
    global _holders, _before
    with _lock:
        _holders += 1
        if _holders == 1:
            _before = gc.get_threshold()
            if collect_first:
                gc.collect()
            gc.freeze()
            if spaced:
                gc.set_threshold(YOUNG, MIDDLE, FULL)


def unsettle() -> None:
    """Undo `settle` once every app that settled has stopped: the thresholds as before,
    and the frozen objects scanned again."""
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0:
            gc.set_threshold(*_before)
            gc.unfreeze()


class PauseObserver:
    """Tells `observe(seconds)` how long each collection held the process. It is called
    inside the collector, so it must not take a lock (a `LoopHistogram`'s observe)."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self._observe = observe
        self._started = 0.0

    def __call__(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._observe(time.perf_counter() - self._started)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
