"""`tether controlplane serve|migrate`: run the control plane or bring its database up to date."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

app = typer.Typer(
    help="Run the control plane (fleet registry, versions, router).", no_args_is_help=True
)
if TYPE_CHECKING:
    from controlplane.settings import ControlPlaneSettings

console = Console()
err = Console(stderr=True)


def _settings(**overrides: Any) -> ControlPlaneSettings:
    from pydantic import ValidationError

    from controlplane.settings import ControlPlaneSettings

    try:
        return ControlPlaneSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        err.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from exc


def _migrate(url: str) -> str:
    from sqlalchemy.exc import SQLAlchemyError

    from controlplane.db import migrate

    try:
        return migrate(url)
    except (SQLAlchemyError, OSError) as exc:
        err.print(f"[red]cannot migrate the database at {url!r}:[/red] {exc}")
        raise typer.Exit(1) from exc


@app.command()
def migrate(
    db: str = typer.Option(None, "--db", help="database URL (default: TETHER_DB_URL)"),
) -> None:
    """Apply every pending Alembic migration to the database."""
    settings = _settings(db_url=db)
    head = _migrate(settings.db_url)
    console.print(f"database at revision [bold]{head}[/bold]")


@app.command()
def serve(
    db: str = typer.Option(None, "--db", help="database URL (default: TETHER_DB_URL)"),
    store: str = typer.Option(None, "--store", help="store URL (default: TETHER_STORE)"),
    host: str = typer.Option(None, "--host", help="bind address (default: TETHER_HOST)"),
    port: int = typer.Option(None, "--port", help="bind port (default: TETHER_PORT)"),
    no_migrate: bool = typer.Option(False, "--no-migrate", help="do not migrate on start"),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
    workers: int = typer.Option(
        1, "--workers", min=1, help="processes sharing the port (each a full control plane)"
    ),
) -> None:
    """Serve the REST API, the router and /metrics (OpenAPI at /docs)."""
    import logging
    import os

    from controlplane import serving
    from controlplane.auth import ensure_admin_token
    from controlplane.db import open_engine, session_factory

    settings = _settings(db_url=db, store=store, host=host, port=port)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if not no_migrate:
        _migrate(settings.db_url)
    engine = open_engine(settings.db_url)
    try:
        generated = ensure_admin_token(session_factory(engine), settings.admin_token)
    finally:
        engine.dispose()
    if generated:
        # Shown once, never logged: the database keeps only its hash.
        console.print(f"first admin token (shown once, keep it): [bold]{generated}[/bold]")
    console.print(f"control plane on http://{settings.host}:{settings.port} (docs at /docs)")
    if workers > 1:
        # Each worker process builds its own app from the same TETHER_* settings; they
        # share only the database, like replicas on separate machines would.
        os.environ.update(
            TETHER_DB_URL=settings.db_url,
            TETHER_STORE=settings.store,
            TETHER_HOST=settings.host,
            TETHER_PORT=str(settings.port),
        )
    serving.run(settings, log_level, workers)
