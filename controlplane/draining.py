"""Whether this control-plane process has begun to shut down.

Owns one process-wide flag: the HTTP protocol sets it when the server starts its graceful
shutdown, and long-polls read it to answer "nothing new yet" at once, so a SIGTERM ends
them with a clean reply (clients poll again, elsewhere) instead of a cancellation that
leaves a traceback per open poll. Never stops the server itself.
"""

from __future__ import annotations

import threading

# How often a waiting long-poll looks at the flag: the longest a shutdown waits for it.
CHECK_INTERVAL_S = 0.25

_began = threading.Event()


def begin() -> None:
    """The server is shutting down: open long-polls should answer now."""
    _began.set()


def draining() -> bool:
    return _began.is_set()
