"""Event-loop CPU of waiting target long-polls across fleet snapshot swaps.

Owns measuring, in one process, the CPU (`time.process_time`) the control plane's event
loop spends on N target long-polls parked in `Fleet.wait_changed` (each re-checks and
waits again, as `app.py`'s long-poll does) while the fleet's snapshot is swapped S times
with no target changing (what every heartbeat that changes an engine's state causes during
a rollout), then once with a new published version. Real `Fleet` on SQLite; the swaps are
installed directly, without reading the database. Then the CPU of the fleet's own snapshot
updates at that size: a read of the database (`Fleet.load` and install, what every
state-changing heartbeat cost before) and a patch of one state-changing heartbeat
(`Fleet.note_beat` and `Fleet.patch`). Prints one JSON line. Never asserts; never used
outside `bench/`.

    python -m bench.target_wakeups [--engines 300] [--swaps 200] [--rebuilds 50]
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import typer

from controlplane.db import migrate, open_engine, session_factory
from controlplane.fleet import Fleet
from controlplane.metrics import Metrics
from controlplane.registry import Registry
from controlplane.runs import Runs
from controlplane.snapshot import FleetSnapshot
from wire import EngineRegister, Heartbeat, RunCreate, SyncState


async def measure(fleet: Fleet, engines: int, swaps: int, rebuilds: int) -> dict[str, float]:
    await fleet.start()
    base = fleet.snapshot
    answered = 0

    async def long_poll(engine_id: str) -> None:
        nonlocal answered
        while fleet.snapshot.targets.get(engine_id) != 1:
            await fleet.wait_changed(60.0)
        answered += 1

    polls = [asyncio.ensure_future(long_poll(e)) for e in base.engines]
    for _ in range(5):
        await asyncio.sleep(0)
    views = list(base.engines.values())
    # Built before the clock starts: only installing them and the wake-ups are timed.
    snapshots = [
        FleetSnapshot.build(
            time.time(),
            [replace(e, in_flight=i % 3, staging_progress=(i % 10) / 10) for e in views],
            base.runs.values(),
            {},
        )
        for i in range(swaps)
    ]
    published = FleetSnapshot.build(
        time.time(), views, [replace(r, latest_version=1) for r in base.runs.values()], {}
    )
    cpu = time.process_time()
    for snapshot in snapshots:
        fleet.install(snapshot)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    swaps_cpu = time.process_time() - cpu
    cpu = time.process_time()
    fleet.install(published)
    await asyncio.gather(*polls)
    wake_cpu = time.process_time() - cpu
    cpu = time.process_time()
    for _ in range(rebuilds):
        fleet.install(fleet.load())
    read_cpu = time.process_time() - cpu
    engine_id = next(iter(fleet.snapshot.engines))
    cpu = time.process_time()
    for i in range(rebuilds):
        beat = Heartbeat(applied_version=1 + i % 2, sync_state=SyncState.READY)
        fleet.note_beat(engine_id, beat, time.time() + 600.0)
        fleet.patch()
    patch_cpu = time.process_time() - cpu
    await fleet.stop()
    return {
        "engines": engines,
        "swaps": swaps,
        "cpu_ms_per_swap": round(swaps_cpu / swaps * 1e3, 3),
        "cpu_ms_publish_wake": round(wake_cpu * 1e3, 3),
        "answered": answered,
        "cpu_ms_per_read": round(read_cpu / rebuilds * 1e3, 3),
        "cpu_ms_per_patch": round(patch_cpu / rebuilds * 1e3, 3),
        "cpu_us_per_engine_read": round(read_cpu / rebuilds / engines * 1e6, 2),
        "cpu_us_per_engine_patch": round(patch_cpu / rebuilds / engines * 1e6, 2),
    }


def main(
    engines: int = typer.Option(300, help="waiting long-polls (one per engine)"),
    swaps: int = typer.Option(200, help="snapshot swaps that change no target"),
    rebuilds: int = typer.Option(50, help="snapshot reads, and patches, timed"),
) -> None:
    """Loop CPU per snapshot swap with N target long-polls waiting; CPU per snapshot read
    and per heartbeat patch."""
    work = Path(tempfile.mkdtemp(prefix="tether-bench-wakeups-"))
    url = f"sqlite:///{work / 'cp.db'}"
    migrate(url)
    engine = open_engine(url)
    sessions = session_factory(engine)
    runs = Runs(sessions, str(work))
    runs.create(RunCreate(run_id="r"))
    registry = Registry(sessions, lease_seconds=600.0)
    for i in range(engines):
        body = EngineRegister(
            url=f"http://10.0.{i // 250}.{i % 250}:8000",
            run_id="r",
            precision="bf16",
            applied_version=0,
            sync_state="ready",
        )
        registry.register(body, None)
    fleet = Fleet(registry, runs, Metrics(), refresh_s=3600.0)
    print(json.dumps(asyncio.run(measure(fleet, engines, swaps, rebuilds))))
    registry.close()
    engine.dispose()


if __name__ == "__main__":
    typer.run(main)
