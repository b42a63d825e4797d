"""The pause gate and the writer-preferring weight lock of the reference engine's HTTP side.

Owns SGLang's admission rules (sglang-api §3): every generation waits, with no timeout,
while the engine is paused or a weight writer is waiting, then counts as in flight until it
returns; a weight mutation runs at once while paused, else waits for every in-flight
generation to finish while new ones queue behind it. Lives on the event loop (asyncio
primitives only). Must never run the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class PauseGate:
    """Admission for generations and exclusion for weight writers."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.paused = False
        self.in_flight = 0
        self._writers = 0

    @asynccontextmanager
    async def generation(self) -> AsyncIterator[None]:
        """Hold a reader slot for a generation's whole life."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self.paused and self._writers == 0)
            self.in_flight += 1
        try:
            yield
        finally:
            async with self._cond:
                self.in_flight -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        """Exclusive access for a weight mutation (no waiting while paused)."""
        if self.paused:
            yield
            return
        async with self._cond:
            self._writers += 1
            try:
                await self._cond.wait_for(lambda: self.in_flight == 0)
            except BaseException:
                self._writers -= 1
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            async with self._cond:
                self._writers -= 1
                self._cond.notify_all()

    async def pause(self) -> None:
        async with self._cond:
            self.paused = True

    async def resume(self) -> None:
        async with self._cond:
            self.paused = False
            self._cond.notify_all()

    async def wait_unpaused(self, timeout: float) -> bool:
        """True once the gate is open, False if still paused after `timeout` seconds."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: not self.paused), timeout)
            except TimeoutError:
                return False
        return True

    async def wait_drained(self) -> None:
        """Until no generation is in flight."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight == 0)
