"""The `tether` command line: `tether <noun> <verb>`, `--help` on everything.

The composition root: it may import every other package, and none imports it. Each noun
lives in its own module of this package and is registered below. Heavy imports (torch,
FastAPI, SQLAlchemy) happen inside commands, so `tether --help` stays fast.
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
    from cli import (
        agent,
        bench,
        controlplane,
        demo,
        deploy,
        engine,
        fleet,
        model,
        sandbox,
        store,
        token,
    )

    app.add_typer(agent.app, name="agent")
    app.add_typer(bench.app, name="bench")
    app.add_typer(controlplane.app, name="controlplane")
    app.add_typer(deploy.app, name="deploy")
    app.add_typer(engine.app, name="engine")
    app.add_typer(fleet.app, name="fleet")
    app.add_typer(model.app, name="model")
    app.add_typer(sandbox.app, name="sandbox")
    app.add_typer(store.app, name="store")
    app.add_typer(token.app, name="token")
    app.command("demo")(demo.demo)


_register()


def main() -> None:
    app()
