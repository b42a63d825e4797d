"""Parse a `tether ...` command line with the real CLI, without running the command.

Deployment files (the Modal plan, the Kubernetes manifests) spell out command lines; these
tests hold them to the parser that will read them, so a renamed or removed flag fails here
and not on a GPU node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import typer.main


def parse_tether(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """(`"tether agent run"`, parsed parameters); raises the parser's error on a bad line.

    Typer vendors its own click, so groups are recognised by shape, not by class.
    """
    from deploy.cli import app

    if not argv or argv[0] != "tether":
        raise ValueError(f"expected a command line starting with 'tether', found {argv!r}")
    command: Any = typer.main.get_command(app)
    path = ["tether"]
    args = list(argv[1:])
    while hasattr(command, "list_commands"):
        if not args:
            raise ValueError(f"{' '.join(path)} needs a sub-command")
        name = args.pop(0)
        sub = command.get_command(command.context_class(command), name)
        if sub is None:
            raise ValueError(f"{' '.join(path)} has no sub-command {name!r}")
        command = sub
        path.append(name)
    with command.make_context(" ".join(path), args) as ctx:
        return " ".join(path), dict(ctx.params)
