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


@app.command("vllm")
def vllm(
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint folder to serve."),
    port: int = typer.Option(8000, "--port", help="TCP port to listen on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind."),
    max_model_len: int = typer.Option(1024, "--max-model-len", help="Longest prompt+output."),
    kv_cache_gib: int = typer.Option(1, "--kv-cache-gib", help="CPU KV cache (GiB)."),
    threads: int | None = typer.Option(None, "--threads", help="OpenMP threads (CPU build)."),
    extra: list[str] = typer.Argument(None, help="More vLLM flags, after `--`."),
) -> None:
    """Serve MODEL with vLLM (from `.venv-vllm`, `make vllm`), ready for an engine agent."""
    import os

    from deploy.vllm_server import VLLMNotInstalled, check_head_size, vllm_command

    if not (model / "config.json").is_file():
        err.print(f"[red]error:[/] {model} has no config.json; pass a Hugging Face folder")
        raise typer.Exit(2)
    try:
        check_head_size(model)
        argv, env = vllm_command(
            model.resolve(),
            port,
            host=host,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            threads=threads,
            extra_args=tuple(extra or ()),
        )
    except (VLLMNotInstalled, ValueError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    # exec: vLLM gets this process's signals (and its process group) directly.
    os.execve(argv[0], argv, {**os.environ, **env})
