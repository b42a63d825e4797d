"""`tether deploy modal --config fleet.toml [--dry-run]`: show the plan, then deploy it.

The plan (one row per pool, then every command line in start order, then notes on GPU
names Modal does not offer) is printed in both modes; `--dry-run` stops there and needs
neither Modal nor credentials. A real deploy runs `python -m modal deploy -m
deploy.modal_app` and then calls the deployed `migrate` function once.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Deploy Tether on real infrastructure.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)

if TYPE_CHECKING:
    from deploy.fleet_config import FleetConfig
    from deploy.modal_app import ModalPlan

MODAL_SETUP_HINT = (
    "install the Modal client (1.2 or newer) and log in:\n"
    "  pip install 'tether[modal]'   # or: pip install 'modal>=1.2'\n"
    "  modal setup                   # or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET\n"
    "then run this command again (or add --dry-run to only print the plan)"
)


def modal_credentials_present() -> bool:
    """Modal reads a token from MODAL_TOKEN_ID/SECRET or from ~/.modal.toml."""
    if os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET"):
        return True
    config = Path(os.environ.get("MODAL_CONFIG_PATH", Path.home() / ".modal.toml"))
    return config.is_file()


def gpu_notes(fleet: FleetConfig, plan: ModalPlan) -> list[str]:
    """What the plan asks of Modal that Modal does not offer by name (the docs' GPU list)."""
    from deploy.modal_app import MODAL_GPU_TYPES, unknown_gpu_types

    notes = [
        f"pool {pool.name!r}: gpu {pool.gpu!r} is not a Modal GPU type (Modal offers "
        f"{', '.join(sorted(MODAL_GPU_TYPES))}); Modal will refuse this deploy"
        for pool in plan.pools
        if unknown_gpu_types([pool.gpu])
    ]
    table = fleet.precision_table()
    for family in sorted(f for f in table if unknown_gpu_types([f])):
        hint = ""
        if family == "B300":
            hint = " (a `B200+` pool may run on a B300 and is looked up as B200)"
        notes.append(
            f"precision table: {family} → {table[family]} is kept for other platforms, "
            f"but {family} is not a Modal GPU type{hint}"
        )
    return notes


def render_plan(plan: ModalPlan) -> None:
    """Print the pools table and the command lines of `plan`."""
    cp = plan.controlplane
    table = Table(title=f"Modal app {plan.app_name!r} · run {plan.run!r} · store {plan.store_url}")
    for column in ("part", "gpu", "precision", "replicas"):
        table.add_column(column, no_wrap=True)
    table.add_column("image", overflow="fold")
    table.add_row(
        f"{cp.name} (web :{cp.port})",
        "-",
        "-",
        f"{cp.min_containers}..{cp.max_containers}",
        cp.image.base,
    )
    for pool in plan.pools:
        table.add_row(
            pool.class_name,
            pool.gpu,
            pool.precision,
            f"{pool.min_containers}..{pool.max_containers}",
            pool.image.base,
        )
    console.print(table)
    mounts = {**cp.volumes, **{m: v for p in plan.pools for m, v in p.volumes.items()}}
    secrets = sorted({*cp.secrets, *(s for p in plan.pools for s in p.secrets)})
    console.print(f"secrets to create: {', '.join(secrets)}")
    console.print("volumes: " + (", ".join(f"{v} at {m}" for m, v in mounts.items()) or "none"))
    commands = Table(title="Commands, in start order", show_lines=False)
    commands.add_column("where", no_wrap=True)
    commands.add_column("command", overflow="fold")
    for where, command in plan.commands():
        commands.add_row(where, command)
    console.print(commands)
    if plan.control_plane_url is None:
        console.print(
            "{control_plane_url} is the control plane's Modal web URL, looked up when a "
            "replica starts; {replica_url} is the replica's own Modal tunnel."
        )


@app.command("modal")
def deploy_modal(
    config: Path = typer.Option(..., "--config", help="Fleet file (see fleet.example.toml)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; deploy nothing."),
    skip_migrate: bool = typer.Option(
        False, "--skip-migrate", help="Do not run the database migration after deploying."
    ),
) -> None:
    """Render the fleet's Modal plan and deploy it (control plane + one class per pool)."""
    from deploy.fleet_config import FleetConfigError, load_fleet
    from deploy.modal_app import FLEET_ENV, MIGRATE_FUNCTION, build_plan, run_migration

    try:
        fleet = load_fleet(config)
        plan = build_plan(fleet)
    except FleetConfigError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    render_plan(plan)
    for note in gpu_notes(fleet, plan):
        console.print(f"[yellow]note:[/] {note}")
    if dry_run:
        return
    if importlib.util.find_spec("modal") is None:
        err.print(f"[red]error:[/] the Modal client is not installed; {MODAL_SETUP_HINT}")
        raise typer.Exit(1)
    if not modal_credentials_present():
        err.print(f"[red]error:[/] no Modal credentials found; {MODAL_SETUP_HINT}")
        raise typer.Exit(1)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, FLEET_ENV: str(config.resolve())}
    # The interpreter's own Modal CLI, whether or not `modal` is on PATH.
    step = [sys.executable, "-m", "modal", "deploy", "-m", "deploy.modal_app"]
    console.print("$ " + " ".join(["modal", *step[3:]]))
    code = subprocess.call(step, cwd=root, env=env, stdout=sys.stdout, stderr=sys.stderr)
    if code != 0:
        err.print(f"[red]error:[/] modal deploy exited with code {code}")
        raise typer.Exit(code)
    if not skip_migrate:
        import modal.exception

        console.print(f"calling {plan.app_name}.{MIGRATE_FUNCTION} (database migration)")
        try:
            head = run_migration(plan.app_name)
        except (modal.exception.Error, RuntimeError) as exc:
            err.print(
                f"[red]error:[/] the migration failed: {exc}; fix the database settings in "
                "the control-plane secret, then rerun (add --skip-migrate to skip it)"
            )
            raise typer.Exit(1) from None
        console.print(f"database schema at {head}")
    console.print(f"[green]deployed[/] Modal app {plan.app_name!r}")
