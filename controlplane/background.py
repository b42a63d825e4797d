"""`BackgroundTask`: one long-running coroutine of a control-plane process, started in the
lifespan and cancelled at shutdown. Owns only starting and stopping; what the coroutine
does belongs to its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    """Runs `work()` as a named asyncio task between `start()` and `stop()`."""

    def __init__(self, name: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self.work = work
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Between `start()` and `stop()`."""
        return self._task is not None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.work(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
