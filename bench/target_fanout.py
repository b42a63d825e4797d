"""A publication's wake-up of a whole fleet's target long-polls, through a served control
plane.

Owns measuring, against `tether controlplane serve` on SQLite, what answering N parked
`GET /v1/engines/{id}/target` long-polls costs when a version is published: the time from
the publication request until each answer arrives (p50, p99, the last) and the control
plane's CPU over that window, per answer. N engines are registered, each parks one
long-poll on a keep-alive connection of its own (a bare HTTP/1.1 client, so the client's
CPU stays small next to the server's on a shared machine), then a version is published;
`--rounds` times. Also the control plane's CPU per second while the polls wait and nothing
changes. Prints one line per round and one JSON line. Never asserts; never used
outside `bench/`.

    python -m bench.target_fanout [--engines 1000] [--rounds 5]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import typer

from bench.router import ADMIN, LONG_LEASE, _cpu_seconds, _percentile, _publish, _start_controlplane
from launcher.processes import ProcessGroup

RUN = "fanout"
# Long enough that no poll times out while the others are parked and the version published.
POLL_TIMEOUT_S = 120
# The quiet window, with every poll parked, over which the control plane's CPU is read.
IDLE_S = 2.0


async def _park(
    host: str, port: int, engine_id: str, after: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"GET /v1/engines/{engine_id}/target?after={after}&timeout={POLL_TIMEOUT_S} HTTP/1.1\r\n"
        f"Host: {host}\r\nAuthorization: Bearer {ADMIN}\r\n\r\n".encode()
    )
    await writer.drain()
    return reader, writer


async def _answer(reader: asyncio.StreamReader) -> tuple[float, bytes]:
    """(arrival time, body) of one HTTP/1.1 answer with a Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    arrived = time.perf_counter()
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return arrived, await reader.readexactly(length)


async def _round(
    cp_url: str, pid: int, store: Path, engine_ids: list[str], version: int
) -> dict[str, float]:
    host, port = cp_url.removeprefix("http://").split(":")
    parked = await asyncio.gather(*(_park(host, int(port), e, version - 1) for e in engine_ids))
    # Every poll reaches its wait: the server has read them all once it answers a probe
    # sent after them on a connection of its own.
    async with httpx.AsyncClient(base_url=cp_url) as client:
        (await client.get("/readyz")).raise_for_status()
    await asyncio.sleep(0.5)
    # What the parked polls cost while nothing changes (with the refresher's own reads).
    idle_cpu = _cpu_seconds(pid)
    await asyncio.sleep(IDLE_S)
    cpu = _cpu_seconds(pid)
    idle_cpu = cpu - idle_cpu
    started = time.perf_counter()
    await asyncio.to_thread(_publish, store, cp_url, RUN, version, False)
    answers = await asyncio.gather(*(_answer(reader) for reader, _ in parked))
    ended = time.perf_counter()
    cpu = _cpu_seconds(pid) - cpu
    for _, writer in parked:
        writer.close()
    bad = [
        body
        for _, body in answers
        if json.loads(body) != {"target_version": version, "changed": True}
    ]
    latencies = sorted((arrived - started) * 1e3 for arrived, _ in answers)
    return {
        "answered": len(answers) - len(bad),
        "p50_ms": round(_percentile(latencies, 0.5), 1),
        "p99_ms": round(_percentile(latencies, 0.99), 1),
        "last_ms": round(latencies[-1], 1),
        "cp_cpu_ms": round(cpu * 1e3, 1),
        "cp_cpu_us_per_answer": round(cpu / len(answers) * 1e6, 1),
        "window_ms": round((ended - started) * 1e3, 1),
        "idle_cp_cpu_ms_per_s": round(idle_cpu / IDLE_S * 1e3, 1),
    }


def main(
    engines: int = typer.Option(1000, min=1, help="engines, each with one parked long-poll"),
    rounds: int = typer.Option(5, min=1, help="publications measured"),
) -> None:
    """Time and control-plane CPU to answer every parked target long-poll of a publication."""
    work = Path(tempfile.mkdtemp(prefix="tether-bench-fanout-"))
    store = work / "store"
    store.mkdir()
    with ProcessGroup(work) as procs:
        cp = _start_controlplane(procs, f"sqlite:///{work / 'cp.db'}", store, env=LONG_LEASE)
        assert cp.url is not None
        _publish(store, cp.url, RUN, 1)
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=cp.url, headers=headers) as client:
            engine_ids = []
            for i in range(engines):
                body = {
                    "url": f"http://10.0.{i // 250}.{i % 250}:8000",
                    "run_id": RUN,
                    "precision": "bf16",
                    "applied_version": 1,
                    "sync_state": "ready",
                }
                reply = client.post("/v1/engines", json=body)
                reply.raise_for_status()
                engine_ids.append(reply.json()["engine_id"])
        print(f"{engines} engines registered; {os.cpu_count()} CPUs; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        results = []
        for version in range(2, 2 + rounds):
            found = asyncio.run(_round(cp.url, cp.process.pid, store, engine_ids, version))
            results.append(found)
            print(f"v{version}: {found}", flush=True)
    summary = {
        "engines": engines,
        "rounds": rounds,
        **{
            f"median_{key}": statistics.median(r[key] for r in results)
            for key in (
                "p50_ms",
                "p99_ms",
                "last_ms",
                "cp_cpu_ms",
                "cp_cpu_us_per_answer",
                "idle_cp_cpu_ms_per_s",
            )
        },
        "answered_all": all(r["answered"] == engines for r in results),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    typer.run(main)
