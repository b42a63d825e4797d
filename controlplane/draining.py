"""Whether this control-plane process has begun to shut down.

Owns one process-wide flag: the HTTP protocol sets it when the server starts its graceful
shutdown, and long-polls read it to answer "nothing new yet" at once, so a SIGTERM ends
them with a clean reply (clients poll again, elsewhere) instead of a cancellation that
leaves a traceback per open poll. Waiting long-polls are woken by the wakers registered
with `on_begin`, not by a timer: a thousand parked polls that each looked at the flag four
times a second cost the event loop 4,000 wake-ups a second. Never stops the server itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_began = threading.Event()
_lock = threading.Lock()
_wakers: list[Callable[[], None]] = []


def begin() -> None:
    """The server is shutting down: open long-polls should answer now."""
    _began.set()
    with _lock:
        wakers = list(_wakers)
    for wake in wakers:
        wake()


def draining() -> bool:
    return _began.is_set()


def on_begin(wake: Callable[[], None]) -> Callable[[], None]:
    """Call `wake` (from whatever thread calls `begin`; it must be thread-safe) when the
    shutdown begins, or now if it has begun. Returns the function that unregisters it."""
    with _lock:
        _wakers.append(wake)
    if _began.is_set():
        wake()

    def forget() -> None:
        with _lock:
            if wake in _wakers:
                _wakers.remove(wake)

    return forget
