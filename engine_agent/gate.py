"""The admission gate: which requests may reach the engine, and on which version.

Owns three rules (architecture §3):

- A request's version constraint is checked and the served version captured under one lock,
  so a commit can never slip between "v7 satisfies you" and "you run on v7".
- Exact-version requests in flight are counted per version; a commit waits for those on the
  version it replaces (bounded), so a request pinned to v7 is answered by v7.
- While a commit holds the gate closed, new requests wait at the gate for at most
  `wait_s` seconds and are then checked against the version the commit flipped to; if the
  gate is still closed they get `VersionNotReady` (the proxy's retryable 409).

A rejected request calls `on_reject`, which wakes the reconciler: the request is evidence a
newer version exists. Lives on the event loop (asyncio primitives only); must never talk
to the engine.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from store.types import VersionConstraint


class VersionNotReady(Exception):
    """The served version does not satisfy the request (or a commit kept the gate closed)."""

    def __init__(self, constraint: VersionConstraint, served: int | None, reason: str) -> None:
        self.constraint = constraint
        self.served = served
        self.reason = reason
        served_text = "nothing yet" if served is None else f"v{served}"
        super().__init__(
            f"this engine serves {served_text}, the request asks for {constraint.describe()}"
            f" ({reason}); retry, or let the router pick another engine"
        )


@dataclass(frozen=True)
class Admission:
    """A request let through: the version captured for it, and whether it was pinned."""

    version: int
    exact: bool


class AdmissionGate:
    """Constraint check, version capture and in-flight accounting for one engine."""

    def __init__(
        self,
        served: int | None = None,
        *,
        wait_s: float = 30.0,
        on_reject: Callable[[VersionConstraint], None] | None = None,
    ) -> None:
        self._cond = asyncio.Condition()
        self._served = served
        self._open = True
        self._wait_s = wait_s
        self._on_reject = on_reject
        self._in_flight = 0
        self._exact: Counter[int] = Counter()

    @property
    def served_version(self) -> int | None:
        return self._served

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def exact_in_flight(self, version: int) -> int:
        return self._exact[version]

    async def admit(self, constraint: VersionConstraint) -> Admission:
        """Check `constraint` and capture the served version atomically, or raise."""
        async with self._cond:
            if not self._open:
                try:
                    async with asyncio.timeout(self._wait_s):
                        await self._cond.wait_for(lambda: self._open)
                except TimeoutError:
                    raise VersionNotReady(
                        constraint, self._served, "a weight update is in progress"
                    ) from None
            served = self._served
            if served is None or not constraint.satisfied_by(served):
                if self._on_reject is not None:
                    self._on_reject(constraint)
                raise VersionNotReady(constraint, served, "version not served here")
            admission = Admission(served, constraint.exact_version is not None)
            self._in_flight += 1
            if admission.exact:
                self._exact[admission.version] += 1
            return admission

    async def release(self, admission: Admission) -> None:
        async with self._cond:
            self._in_flight -= 1
            if admission.exact:
                self._exact[admission.version] -= 1
                if self._exact[admission.version] <= 0:
                    del self._exact[admission.version]
            self._cond.notify_all()

    @asynccontextmanager
    async def admitted(self, constraint: VersionConstraint) -> AsyncIterator[Admission]:
        """`admit` for the body of the block, `release` at its end (however it ends)."""
        admission = await self.admit(constraint)
        try:
            yield admission
        finally:
            await self.release(admission)

    async def close(self) -> None:
        """Stop admitting; requests arriving now wait for `reopen` (up to `wait_s`)."""
        async with self._cond:
            self._open = False

    async def wait_exact_drained(self, version: int | None, timeout_s: float) -> int:
        """Wait until no exact request pinned to `version` is in flight; return how many
        still are when `timeout_s` runs out (0 when drained)."""
        return await self._wait(
            lambda: version is None or self._exact[version] == 0,
            timeout_s,
            (lambda: 0 if version is None else self._exact[version]),
        )

    async def wait_drained(self, timeout_s: float) -> int:
        """Wait until nothing is in flight; return how many still are after `timeout_s`."""
        return await self._wait(lambda: self._in_flight == 0, timeout_s, lambda: self._in_flight)

    async def _wait(
        self, done: Callable[[], bool], timeout_s: float, left: Callable[[], int]
    ) -> int:
        async with self._cond:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._cond.wait_for(done)
            except TimeoutError:
                pass
            return left()

    async def reopen(self, served: int | None) -> None:
        """Serve `served` from now on and let waiting requests through."""
        async with self._cond:
            self._served = served
            self._open = True
            self._cond.notify_all()
