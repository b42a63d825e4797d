"""`tether demo`: the whole system on one machine, training a tiny model with GRPO.

By default (`deploy.demo`): a control plane on SQLite, a folder store, three CPU reference
engines (BF16, FP8, NVFP4) each behind its agent, and a trainer that learns to add two
digits, sampling through the router with a bounded lag, publishing a version every step and
correcting the sampler gap with MIS. Ends with a summary table and one JSON line.

`--store-only` (or `--versions N`) keeps the interim store demo: generated versions published
through the store protocol and listed, in seconds, with no engines.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from deploy.cli.store import console, fail, progress_bar, user_errors, versions_table
from store.settings import DEFAULT_STORE_URL


def demo(
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Training steps [40].")
    ] = None,
    engines: Annotated[
        int | None,
        typer.Option("--engines", min=1, max=64, help="Engines, BF16/FP8/NVFP4 in turn [3]."),
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

    from deploy.demo.settings import DemoSettings
    from deploy.processes import ProcessFailed

    with user_errors():
        _check_inputs(store_url, codec)
        try:
            given = {
                "steps": steps,
                "engines": engines,
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
        from deploy.demo.run import run_demo

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
    from store.anchor import AnchorPolicy
    from store.codecs import encode_version, get_codec
    from store.store import Store
    from store.synthetic import random_checkpoint, small_update
    from store.types import VersionKind, VersionRef

    started = time.perf_counter()
    with user_errors():
        if get_codec(codec).kind is not VersionKind.DELTA:
            raise typer.BadParameter(f"{codec!r} is not a delta codec; use sparse or xor")
        run_id = run or "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        store = Store(store_url)
        store.create_run(run_id, base_checkpoint="generated:random-bf16")
        policy = AnchorPolicy(every=anchor_every)
        tensors = random_checkpoint(seed=seed)
        previous = None
        last_anchor: int | None = None
        kinds: list[str] = []
        sizes: list[int] = []
        with progress_bar() as update:
            for version in range(versions):
                if previous is not None:
                    tensors = small_update(previous, seed=seed * 7919 + version, fraction=0.03)
                full = encode_version(
                    tensors, None, version=version, base_version=None, codec="full"
                )
                delta = None
                if previous is not None:
                    delta = encode_version(
                        tensors, previous, version=version, base_version=version - 1, codec=codec
                    )
                kind = policy.choose(
                    version,
                    last_anchor,
                    None if delta is None else _size(delta),
                    _size(full),
                )
                files = full if kind is VersionKind.FULL or delta is None else delta
                store.publish(VersionRef(run_id, version), files)
                if kind is VersionKind.FULL:
                    last_anchor = version
                kinds.append(str(kind))
                sizes.append(_size(files))
                previous = tensors
                update(version + 1, versions, f"published {run_id} v{version} ({kind})")
        problems = [
            problem
            for version in store.list_versions(run_id)
            for problem in store.verify(VersionRef(run_id, version)).problems
        ]
        rebuilt = store.materialize(run_id, versions - 1)
        identical = all(bytes(rebuilt[name].data) == bytes(t.data) for name, t in tensors.items())
        console.print(versions_table(store, run_id))
        full_bytes = sizes[0]
        deltas = [size for size, kind in zip(sizes, kinds, strict=True) if kind == "delta"]
        figures = {
            "store": store.url,
            "run": run_id,
            "versions": versions,
            "pointer": str(store.read_pointer(run_id)),
            "kinds": kinds,
            "full_bytes": full_bytes,
            "mean_delta_over_full": round(sum(deltas) / len(deltas) / full_bytes, 4)
            if deltas
            else None,
            "verified": not problems,
            "latest_bit_identical": identical,
            "seconds": round(time.perf_counter() - started, 3),
        }
    print(json.dumps(figures))
    if problems or not identical:
        raise typer.Exit(1)


def _size(files: dict[str, bytes]) -> int:
    return sum(len(data) for data in files.values())
