"""`tether engine ...`: start an inference engine process."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Inference engines.", no_args_is_help=True)
err = Console(stderr=True, soft_wrap=True)


@app.command("reference")
def reference(
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint folder to serve."),
    port: int = typer.Option(30000, "--port", help="TCP port to listen on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind."),
    precision: str = typer.Option(
        "auto", "--precision", help="auto | bf16 | fp8 | nvfp4: refuse checkpoints of another."
    ),
    weight_version: str = typer.Option(
        "default", "--weight-version", help="Initial weight version label (SGLang's default)."
    ),
    threads: int = typer.Option(1, "--threads", help="torch CPU threads for this engine."),
    served_model_name: str | None = typer.Option(None, "--served-model-name"),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Serve MODEL with the CPU reference engine (SGLang's HTTP API subset)."""
    from pydantic import ValidationError

    from reference_engine.server import serve
    from reference_engine.settings import ReferenceEngineSettings

    if not (model / "config.json").is_file():
        err.print(f"[red]error:[/] {model} has no config.json; pass a Hugging Face folder")
        raise typer.Exit(2)
    try:
        settings = ReferenceEngineSettings(
            model_path=model,
            port=port,
            host=host,
            precision=precision,
            weight_version=weight_version,
            threads=threads,
            served_model_name=served_model_name,
            log_level=log_level,
        )
    except ValidationError as exc:
        err.print(
            f"[red]error:[/] invalid option: {exc.errors()[0]['msg']} ({exc.errors()[0]['loc']})"
        )
        raise typer.Exit(2) from None
    try:
        serve(settings)
    except (ValueError, FileNotFoundError) as exc:
        # PrecisionMismatch, TensorMismatch and unreadable checkpoints: user errors.
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
