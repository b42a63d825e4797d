"""`tether token create --role ...`: mint a bearer token straight into the database."""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(help="Mint bearer tokens for the control plane.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)


@app.command()
def create(
    role: str = typer.Option(..., "--role", help="admin, trainer, engine, client or viewer"),
    name: str = typer.Option("", "--name", help="a label for the token"),
    db: str = typer.Option(None, "--db", help="database URL (default: TETHER_DB_URL)"),
) -> None:
    """Create a token for ROLE and print it once (only its hash is stored)."""
    from sqlalchemy.exc import SQLAlchemyError

    from controlplane.auth import mint_token
    from controlplane.db import open_engine, session_factory
    from controlplane.settings import ControlPlaneSettings
    from wire import Role

    try:
        parsed = Role(role)
    except ValueError as exc:
        err.print(
            f"[red]unknown role {role!r}:[/red] use one of {', '.join(r.value for r in Role)}"
        )
        raise typer.Exit(2) from exc
    url = db or ControlPlaneSettings().db_url
    engine = open_engine(url)
    try:
        token_id, text = mint_token(session_factory(engine), parsed, name)
    except SQLAlchemyError as exc:
        err.print(
            f"[red]cannot write to the database at {url!r}:[/red] {exc.__class__.__name__}; "
            "run 'tether controlplane migrate' first"
        )
        raise typer.Exit(1) from exc
    finally:
        engine.dispose()
    console.print(f"token {token_id} ({parsed.value}): [bold]{text}[/bold]")
