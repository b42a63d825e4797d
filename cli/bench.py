"""`tether bench <name>`: the benchmark scripts under `bench/`, one command each.

Each `bench/<name>.py` exposes `run(...)` (a Typer-compatible function whose module keeps
its top-level imports light) and runs standalone as `python -m bench.<name>`.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="Run a benchmark; each ends with one JSON line of its figures.")

from bench import sandbox as _sandbox_bench  # noqa: E402

app.command(name="sandbox", help="Local sandbox: tasks scored per minute, isolation overhead.")(
    _sandbox_bench.run
)

from bench import codec as _codec_bench  # noqa: E402

app.command(name="codec", help="Checkpoint codecs: delta size vs xor and entropy, GB/s.")(
    _codec_bench.run
)

from bench import refit as _refit_bench  # noqa: E402

app.command(name="refit", help="Engine refit: staged commit pause vs naive full reload.")(
    _refit_bench.run
)

from bench import router as _router_bench  # noqa: E402

app.command(name="router", help="Router: added latency and req/s vs direct and SGLang's router.")(
    _router_bench.run
)

from bench import convert as _convert_bench  # noqa: E402

app.command(
    name="convert", help="FP8/NVFP4 conversion: full and incremental GB/s per core, identity."
)(_convert_bench.run)

from bench import overview as _overview_bench  # noqa: E402

app.command(name="overview", help="Dashboard overview: cost per snapshot vs the snapshot build.")(
    _overview_bench.run
)

from bench import chaos as _chaos_bench  # noqa: E402

app.command(name="chaos", help="Fault scenarios under a pinned load: requests lost, recovery.")(
    _chaos_bench.run
)

from bench import fleet as _fleet_bench  # noqa: E402

app.command(name="fleet", help="A swarm of real agents: convergence, store egress, heartbeats.")(
    _fleet_bench.run
)

from bench import sessions as _sessions_bench  # noqa: E402

app.command(
    name="sessions", help="Multi-turn sessions: prefix-cache hit rate sticky vs affinity vs random."
)(_sessions_bench.run)

from bench import plan_layout as _plan_layout_bench  # noqa: E402

app.command(
    name="plan-layout", help="Fetch-plan trees: children per parent, store roots, two-lane peers."
)(_plan_layout_bench.run)
