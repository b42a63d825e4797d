"""`tether model ...`: create and convert model checkpoints."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Model checkpoints.", no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)


@app.command("init-tiny")
def init_tiny(
    out: Path = typer.Option(..., "--out", help="Folder to write the checkpoint into."),
    seed: int = typer.Option(0, "--seed", help="Random seed; same seed, same bytes."),
    hidden: int = typer.Option(128, "--hidden", help="Hidden size (= heads × head dim)."),
    layers: int = typer.Option(2, "--layers", help="Decoder layers."),
    heads: int = typer.Option(4, "--heads", help="Attention heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", help="Key/value heads."),
    head_dim: int = typer.Option(32, "--head-dim", help="Dimension per head."),
    intermediate: int = typer.Option(384, "--intermediate", help="MLP intermediate size."),
) -> None:
    """Write a small random Qwen3 model with an offline tokenizer (for tests and the demo)."""
    from reference_engine.tiny_model import TinyModelSpec, init_tiny_model

    spec = TinyModelSpec(
        seed=seed,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
    )
    try:
        path = init_tiny_model(out, spec)
    except ValueError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    console.print(f"wrote tiny Qwen3 model to [bold]{path}[/]")


@app.command("convert")
def convert(
    src: Path = typer.Option(..., "--src", help="Canonical BF16 checkpoint folder."),
    precision: str = typer.Option(..., "--precision", help="bf16 | fp8 | nvfp4"),
    out: Path = typer.Option(..., "--out", help="Folder to write the converted checkpoint."),
    input_scales_from: Path | None = typer.Option(
        None, "--input-scales-from", help="NVFP4 folder whose input_scale values to reuse."
    ),
) -> None:
    """Convert a BF16 checkpoint to FP8 (128×128 blocks) or NVFP4 (ModelOpt layout)."""
    from engine_agent.precision import convert_checkpoint, read_input_scales

    try:
        scales = read_input_scales(input_scales_from) if input_scales_from else None
        with console.status(f"converting {src} to {precision}"):
            stats = convert_checkpoint(src, precision, out, scales)
    except (ValueError, FileNotFoundError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    table = Table("field", "value")
    for key, value in vars(stats).items():
        table.add_row(key, str(value))
    console.print(table)
