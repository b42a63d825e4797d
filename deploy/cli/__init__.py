"""The `tether` command line: `tether <noun> <verb>`, `--help` on everything.

Each noun lives in its own module of this package and is registered below. Heavy imports
(torch, FastAPI, SQLAlchemy) happen inside commands, so `tether --help` stays fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="tether",
    help="Tether: the control plane for the rollout fleet of asynchronous RL on LLMs.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _register() -> None:
    # One line per noun; keep them sorted.
    from deploy.cli import bench, store

    app.add_typer(bench.app, name="bench")
    app.add_typer(store.app, name="store")


_register()


def main() -> None:
    app()
