"""`tether agent run`: the engine agent beside one inference engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console

app = typer.Typer(help="The engine agent (sidecar beside each engine).", no_args_is_help=True)
err = Console(stderr=True)


@app.command("run")
def run(
    engine_url: str = typer.Option(None, "--engine-url", help="The engine's HTTP URL."),
    engine_kind: str = typer.Option(
        None, "--engine-kind", help="sglang (SGLang or the reference engine; default) | vllm"
    ),
    precision: str = typer.Option(None, "--precision", help="bf16 | fp8 | nvfp4"),
    control_plane: list[str] = typer.Option(
        None,
        "--control-plane",
        help="Control plane URL; repeat it (or separate URLs by commas) for replicas the "
        "agent fails over between. Without it, follow the store pointer.",
    ),
    token: str = typer.Option(
        None, "--token", help="Engine-role bearer token (or TETHER_TOKEN).", show_default=False
    ),
    store: str = typer.Option(None, "--store", help="Store URL (folder, file://, s3://)."),
    run_id: str = typer.Option(None, "--run", help="Run id to follow."),
    host: str = typer.Option(None, "--host", help="Interface of the agent's proxy."),
    port: int = typer.Option(None, "--port", help="Port of the agent's proxy (0: any)."),
    advertise_url: str = typer.Option(
        None, "--advertise-url", help="URL to register (default http://HOST:PORT)."
    ),
    boot_model: Path = typer.Option(
        None, "--boot-model", help="Checkpoint folder the engine booted from."
    ),
    boot_version: int = typer.Option(
        None, "--boot-version", help="Version the boot checkpoint holds."
    ),
    work_dir: Path = typer.Option(None, "--work-dir", help="Folder for staged checkpoints."),
    pause_mode: str = typer.Option(None, "--pause-mode", help="in_place (default) | quiesce"),
    accelerator: str = typer.Option(None, "--accelerator", help="e.g. cpu, h100, b200."),
    capacity: int = typer.Option(None, "--capacity", help="Concurrent requests it can take."),
    engine_connections: int = typer.Option(
        None,
        "--engine-connections",
        help="Most requests forwarded to the engine at once (default 1024); keep it above "
        "the engine's running-request limit.",
    ),
    label: list[str] = typer.Option(None, "--label", help="key=value, repeatable."),
    peer_fetch: bool = typer.Option(
        None,
        "--peer-fetch/--no-peer-fetch",
        help="Fetch version files from peers the control plane names (verified against "
        "the store) and serve held files to peers (default on; docs/peers.md).",
    ),
    fetch_source: list[str] = typer.Option(
        None,
        "--fetch-source",
        help="An HTTP cache / P2P distributor base URL or a store mirror URL tried before "
        "the store, verified the same way; repeatable.",
    ),
    log_level: str = typer.Option(None, "--log-level", help="debug | info | warning"),
) -> None:
    """Keep an engine on its target version and serve it through the versioned proxy."""
    import asyncio
    import logging

    from pydantic import ValidationError

    from engine_agent.agent import Agent
    from engine_agent.settings import AgentSettings

    given: dict[str, Any] = {
        "engine_url": engine_url,
        "engine_kind": engine_kind,
        "precision": precision,
        "control_plane": control_plane or None,
        "token": token,
        "store": store,
        "run": run_id,
        "host": host,
        "port": port,
        "advertise_url": advertise_url,
        "boot_model": boot_model,
        "boot_version": boot_version,
        "work_dir": work_dir,
        "pause_mode": pause_mode,
        "accelerator": accelerator,
        "capacity": capacity,
        "engine_connections": engine_connections,
        "labels": label or None,
        "peer_fetch": peer_fetch,
        "fetch_sources": fetch_source or None,
        "log_level": log_level,
    }
    try:
        settings = AgentSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "settings"
            err.print(f"[red]error:[/] {where}: {error['msg']}")
        err.print("see `tether agent run --help`; every flag also reads TETHER_AGENT_<NAME>")
        raise typer.Exit(2) from None
    if settings.boot_model is not None and not (settings.boot_model / "config.json").is_file():
        err.print(f"[red]error:[/] --boot-model {settings.boot_model} has no config.json")
        raise typer.Exit(2)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per engine call would drown the agent's own log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        agent = Agent(settings)
    except OSError as exc:
        err.print(f"[red]error:[/] cannot listen on {settings.host}:{settings.port}: {exc}")
        raise typer.Exit(2) from None
    code = asyncio.run(agent.run())
    raise typer.Exit(code)
