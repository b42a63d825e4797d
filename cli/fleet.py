"""`tether fleet status` and `tether fleet watch`: the dashboard's picture in a terminal.

Owns reading `GET /v1/fleet/overview` and drawing it as Rich tables (per-precision summary,
version convergence, engines), or printing the document itself with `--json`. Read-only:
it never changes fleet state, and it prints no token.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

app = typer.Typer(help="Look at the fleet: engines, versions, convergence.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)

ControlPlaneOption = typer.Option(
    "http://127.0.0.1:8000",
    "--control-plane",
    envvar="TETHER_CONTROL_PLANE",
    help="Control plane URL (or TETHER_CONTROL_PLANE).",
)
TokenOption = typer.Option(
    None,
    "--token",
    envvar="TETHER_TOKEN",
    help="A viewer, client or trainer token (or TETHER_TOKEN).",
    show_default=False,
)
RunOption = typer.Option(None, "--run", help="Only this run (default: every run).")
LimitOption = typer.Option(
    50, "--limit", min=0, help="Engine rows to draw (0: none; the summary covers all)."
)


class OverviewUnavailable(RuntimeError):
    """The control plane could not be read; the message says what to fix."""


def fetch_overview(control_plane: str, token: str | None, timeout_s: float = 10.0) -> Any:
    """The overview document, or `OverviewUnavailable` with the reason and the fix."""
    if not token:
        raise OverviewUnavailable(
            "no token: pass --token or set TETHER_TOKEN (tether token create --role viewer)"
        )
    url = control_plane.rstrip("/") + "/v1/fleet/overview"
    try:
        reply = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise OverviewUnavailable(
            f"cannot reach {url}: {exc.__class__.__name__}; check --control-plane"
        ) from exc
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        raise OverviewUnavailable(f"{url} answered {reply.status_code}: {message}")
    return reply.json()


def only_run(doc: dict[str, Any], run: str | None) -> dict[str, Any]:
    """The document restricted to one run (unchanged when `run` is None)."""
    if run is None:
        return doc
    return {
        **doc,
        "engines": [e for e in doc["engines"] if e["run_id"] == run],
        "precisions": [p for p in doc["precisions"] if p["run_id"] == run],
        "runs": [r for r in doc["runs"] if r["run_id"] == run],
    }


def _v(version: int | None) -> str:
    return "—" if version is None else f"v{version}"


def _s(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.1f}s"


def render(doc: dict[str, Any], limit: int) -> Group:
    """The overview as Rich renderables: runs, precisions, engines (sorted by lag)."""
    rates = doc["rates"]
    parts: list[Any] = []
    for run in doc["runs"]:
        gap = run["gap"][-1] if run["gap"] else None
        timeline = Table(
            title=f"run {run['run_id']}: latest {_v(run['latest_version'])} "
            f"({run['policy']}) · 409 {rates['not_ready_per_s']:.2f}/s · "
            f"retries {rates['retries_per_s']:.2f}/s"
            + (
                f" · staleness mean {gap['staleness_mean']:.2f}"
                if gap and gap.get("staleness_mean") is not None
                else ""
            ),
            title_justify="left",
        )
        for name in ("version", "serving", "50%", "90%", "100%"):
            timeline.add_column(name, justify="right")
        for t in list(reversed(run["timeline"]))[:5]:
            timeline.add_row(
                _v(t["version"]),
                f"{100 * t['serving_fraction']:.0f}%",
                _s(t["t50_s"]),
                _s(t["t90_s"]),
                _s(t["t100_s"]),
            )
        parts.append(timeline)
    summary = Table(title="by precision", title_justify="left")
    for name in ("run", "precision", "engines", "serving", "versions", "lag max", "in flight",
                 "gap k3"):  # fmt: skip
        summary.add_column(name)
    gaps = {r["run_id"]: (r["gap"][-1]["precisions"] if r["gap"] else {}) for r in doc["runs"]}
    for p in doc["precisions"]:
        k3 = gaps.get(p["run_id"], {}).get(p["precision"])
        summary.add_row(
            p["run_id"],
            p["precision"],
            str(p["engines"]),
            str(p["serving"]),
            " ".join(f"{'—' if v == 'none' else 'v' + v}×{n}" for v, n in p["versions"].items()),
            "—" if p["lag_max"] is None else str(p["lag_max"]),
            str(p["in_flight"]),
            "—" if k3 is None else f"{k3['k3_kl']:.4f}",
        )
    parts.append(summary)
    if limit:
        engines = sorted(doc["engines"], key=lambda e: (-(e["lag"] or 0), e["engine_id"]))
        table = Table(
            title=f"engines ({min(limit, len(engines))} of {len(engines)}, most behind first)",
            title_justify="left",
        )
        for name in ("engine", "precision", "accelerator", "kind", "served", "target", "state",
                     "staging", "in flight", "lease age"):  # fmt: skip
            table.add_column(name)
        for e in engines[:limit]:
            staging = (
                "—"
                if e["staging_target"] is None
                else f"{_v(e['staging_target'])} {100 * e['staging_progress']:.0f}%"
            )
            table.add_row(
                e["engine_id"][:12],
                e["precision"],
                e["accelerator"],
                e["kind"] or "—",
                _v(e["applied_version"]),
                _v(e["target_version"]),
                e["sync_state"],
                staging,
                f"{e['in_flight']}/{e['capacity']}",
                _s(e["heartbeat_age_s"]),
            )
        parts.append(table)
    return Group(*parts)


@app.command()
def status(
    control_plane: str = ControlPlaneOption,
    token: str = TokenOption,
    run: str = RunOption,
    limit: int = LimitOption,
    as_json: bool = typer.Option(False, "--json", help="Print the overview document as JSON."),
) -> None:
    """Print the fleet once: versions and convergence, a summary per precision, engines."""
    try:
        doc = only_run(fetch_overview(control_plane, token), run)
    except OverviewUnavailable as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(doc))
        return
    console.print(render(doc, limit))


@app.command()
def watch(
    control_plane: str = ControlPlaneOption,
    token: str = TokenOption,
    run: str = RunOption,
    limit: int = LimitOption,
    interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between reads."),
    count: int = typer.Option(0, "--count", min=0, help="Stop after this many reads (0: never)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document per line."),
) -> None:
    """Redraw the fleet every INTERVAL seconds until Ctrl-C (or COUNT reads)."""
    reads = 0

    def read() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return only_run(fetch_overview(control_plane, token), run)

    try:
        if as_json:
            while True:
                print(json.dumps(read()), flush=True)
                if count and reads >= count:
                    return
                time.sleep(interval)  # the refresh period the user asked for
        with Live(render(read(), limit), console=console, auto_refresh=False) as live:
            while not count or reads < count:
                time.sleep(interval)  # the refresh period the user asked for
                live.update(render(read(), limit), refresh=True)
    except OverviewUnavailable as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        return
