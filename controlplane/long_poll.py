"""Long-polls: a request that waits for an answer to change, and the engines' target poll.

Owns the wait loop every long-poll route uses (`long_poll`) and the answer to
`GET /v1/engines/{engine_id}/target` (`wait_for_target`), which both lanes serve: the hot
lane (`controlplane/hotpath.py`), where a publication answers a whole fleet's parked
polls at once and FastAPI's per-request machinery was most of each answer's CPU, and the
FastAPI route declared for OpenAPI. Reads the fleet snapshot only; never the database.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from controlplane.draining import draining
from controlplane.fleet import STALE_AFTER_S
from wire import TargetReply

if TYPE_CHECKING:
    from controlplane.services import Services


async def long_poll(
    check: Callable[[], Coroutine[Any, Any, Any]],
    wait: Callable[[float], Coroutine[Any, Any, None]],
    timeout: float,
) -> Any:
    """Call `check` until it returns something not None or `timeout` passes, or the server
    begins to shut down (the caller then answers as on a timeout). `wait(left)` returns
    after at most `left` seconds, and at once when the shutdown begins (its waiters are
    woken through `draining.on_begin`)."""
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        left = deadline - time.monotonic()
        if found is not None or left <= 0 or draining():
            return found
        await wait(left)


async def wait_for_target(
    cp: Services, engine_id: str, after: int | None, timeout: float
) -> TargetReply:
    """`engine_id`'s target version once it differs from `after`, or `after` unchanged
    when `timeout` (at most `max_long_poll_s`) passes first."""
    arrived = time.time()
    run_id = await cp.fleet.engine_run(engine_id)

    async def check() -> int | None:
        snap = cp.fleet.snapshot
        if engine_id not in snap.engines and snap.read_at < time.time() - STALE_AFTER_S:
            return None
        target = snap.target_for(engine_id, run_id)
        return target if target is not None and target != after else None

    found = await long_poll(check, cp.fleet.wait_changed, min(timeout, cp.settings.max_long_poll_s))
    if found is None:
        return TargetReply(target_version=after, changed=False)
    run = cp.fleet.snapshot.runs.get(run_id)
    if run is not None and run.latest_version == found and run.latest_published_at:
        # This process's part of the wake-up: from when it could first have answered.
        waited_from = max(arrived, run.latest_published_at)
        cp.metrics.target_wake.observe(max(0.0, time.time() - waited_from))
    return TargetReply(target_version=found, changed=True)
