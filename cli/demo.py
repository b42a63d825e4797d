"""`tether demo`: the whole system on one machine, training a tiny model with GRPO.

By default (`demo`): a control plane on SQLite, a folder store, three CPU reference
engines (BF16, FP8, NVFP4) each behind its agent, and a trainer that learns to add two
digits, sampling through the router with a bounded lag, publishing a version every step and
correcting the sampler gap with MIS. Ends with a summary table and one JSON line.

`--store-only` (or `--versions N`) keeps the interim store demo: generated versions published
through the store protocol and listed, in seconds, with no engines.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.store import console, fail, progress_bar, user_errors, versions_table
from store.settings import DEFAULT_STORE_URL


def demo(
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Training steps [40].")
    ] = None,
    engines: Annotated[
        str | None,
        typer.Option(
            "--engines",
            help="A count (reference engines, BF16/FP8/NVFP4 in turn) or precision:kind "
            "per engine, e.g. bf16:vllm,fp8:reference,nvfp4:reference [3].",
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of the model, task and sampling [0].")
    ] = None,
    store_url: Annotated[
        str | None,
        typer.Option(
            "--store",
            envvar="TETHER_STORE",
            help="Store URL (folder, file://, s3://BUCKET/PREFIX); default: WORKDIR/store.",
        ),
    ] = None,
    db: Annotated[
        str | None,
        typer.Option(
            "--db", help="Control-plane database URL (e.g. postgresql://...); default SQLite."
        ),
    ] = None,
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--workdir", help="Models, logs, SQLite file and folder store [./.tether/demo]."
        ),
    ] = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Run id (default: demo-<UTC timestamp>).")
    ] = None,
    max_lag: Annotated[
        int | None,
        typer.Option("--max-lag", min=0, help="Min version = latest - this [0]."),
    ] = None,
    prompts: Annotated[
        int | None, typer.Option("--prompts", min=1, help="Prompts per step [12].")
    ] = None,
    group_size: Annotated[
        int | None, typer.Option("--group-size", min=2, help="Samples per prompt [4].")
    ] = None,
    codec: Annotated[str, typer.Option("--codec", help="Delta codec: sparse or xor.")] = "sparse",
    anchor_every: Annotated[
        int | None,
        typer.Option("--anchor-every", min=1, help="A FULL anchor every K versions [10]."),
    ] = None,
    store_only: Annotated[
        bool, typer.Option("--store-only", help="Only publish generated versions to a store.")
    ] = False,
    versions: Annotated[
        int | None,
        typer.Option("--versions", min=1, help="Store-only demo: versions to publish."),
    ] = None,
) -> None:
    """Run the whole system locally and train a tiny model (or --store-only).

    Defaults in brackets; each option also reads TETHER_DEMO_<NAME> (e.g. TETHER_DEMO_STEPS).
    """
    if store_only or versions is not None:
        _store_only(
            store_url or DEFAULT_STORE_URL, versions or 6, run, anchor_every or 4, codec, seed or 0
        )
        return
    from pydantic import ValidationError

    from demo.settings import DemoSettings, parse_engines
    from launcher.processes import ProcessFailed

    with user_errors():
        _check_inputs(store_url, codec)
        count, layout = None, None
        if engines is not None:
            try:
                count, layout = parse_engines(engines)
            except ValueError as exc:
                raise fail(str(exc)) from None
        try:
            given: dict[str, Any] = {
                "steps": steps,
                "engines": count,
                "layout": layout,
                "seed": seed,
                "store": store_url,
                "db": db,
                "workdir": workdir,
                "run_id": run,
                "max_lag": max_lag,
                "prompts_per_step": prompts,
                "group_size": group_size,
                "codec": codec,
                "anchor_every": anchor_every,
            }
            settings = DemoSettings(**{k: v for k, v in given.items() if v is not None})
        except ValidationError as exc:
            first = exc.errors()[0]
            raise fail(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        from demo.run import run_demo

        try:
            summary = run_demo(settings, console)
        except ProcessFailed as exc:
            raise fail(str(exc), 1) from None
        except KeyboardInterrupt:
            raise fail("interrupted; every process the demo started was stopped", 130) from None
    print(json.dumps(summary), flush=True)
    if summary["constraint_violations"]:
        raise typer.Exit(1)


def _check_inputs(store_url: str | None, codec: str) -> None:
    """Refuse a bad store URL or codec before any process starts."""
    from store.codecs import get_codec
    from store.store import Store
    from store.types import VersionKind

    if store_url is not None:
        Store(store_url)
    if get_codec(codec).kind is not VersionKind.DELTA:
        raise typer.BadParameter(f"{codec!r} is not a delta codec; use sparse or xor")


def _store_only(
    store_url: str, versions: int, run: str | None, anchor_every: int, codec: str, seed: int
) -> None:
    """The interim store demo: generated versions, published, verified and listed."""
    from demo.store_only import publish_generated
    from store.codecs import get_codec
    from store.store import Store
    from store.types import VersionKind

    with user_errors():
        if get_codec(codec).kind is not VersionKind.DELTA:
            raise typer.BadParameter(f"{codec!r} is not a delta codec; use sparse or xor")
        run_id = run or "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        store = Store(store_url)
        with progress_bar() as update:
            figures = publish_generated(
                store,
                run_id,
                versions,
                anchor_every=anchor_every,
                codec=codec,
                seed=seed,
                on_version=lambda version, kind: update(
                    version + 1, versions, f"published {run_id} v{version} ({kind})"
                ),
            )
        console.print(versions_table(store, run_id))
    print(json.dumps(figures))
    if not (figures["verified"] and figures["latest_bit_identical"]):
        raise typer.Exit(1)
