"""`tether token create --role ...`: mint a bearer token straight into the database.

The token alone goes to stdout (so `TOKEN=$(tether token create ...)` works); everything
else goes to stderr. Without `--db` it writes where `tether controlplane serve` reads
without `--db`: `ControlPlaneSettings().db_url` (TETHER_DB_URL), the one default.
"""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(help="Mint bearer tokens for the control plane.", no_args_is_help=True)
err = Console(stderr=True)


@app.command()
def create(
    role: str = typer.Option(..., "--role", help="admin, trainer, engine, client or viewer"),
    name: str = typer.Option("", "--name", help="a label for the token"),
    db: str = typer.Option(
        None, "--db", help="database URL (default: TETHER_DB_URL, as `controlplane serve`)"
    ),
) -> None:
    """Create a token for ROLE and print it once (only its hash is stored)."""
    from sqlalchemy import make_url
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
    # Shown without its password: the URL may carry one.
    where = make_url(url).render_as_string(hide_password=True)
    engine = open_engine(url)
    try:
        token_id, text = mint_token(session_factory(engine), parsed, name)
    except SQLAlchemyError as exc:
        err.print(
            f"[red]cannot write to the database at {where!r}:[/red] {exc.__class__.__name__}; "
            "run 'tether controlplane migrate' first"
        )
        raise typer.Exit(1) from exc
    finally:
        engine.dispose()
    err.print(f"token {token_id} ({parsed.value}) stored in {where}")
    # Plain print: no markup or wrapping may touch the one line scripts capture.
    print(text)
