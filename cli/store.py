"""`tether store ...`: publish, list, show, verify and garbage-collect policy versions.

Thin commands over `store.Store` (and the trainer's `Publisher` for `publish`): they parse
flags, call the store and render Rich tables and progress bars. Bad input (an unsupported
URL, a missing store folder, an unknown run or version) prints one line and exits 2; a
failed verification exits 1. Only `publish` and `gc` without `--dry-run` write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from store.settings import DEFAULT_STORE_URL

if TYPE_CHECKING:
    from store.store import Store
    from store.types import VersionRef

app = typer.Typer(help="Inspect and maintain the policy-version store.", no_args_is_help=True)
console = Console()
errors = Console(stderr=True)

EXIT_PROBLEM = 1
EXIT_BAD_INPUT = 2

StoreOption = Annotated[
    str,
    typer.Option(
        "--store",
        envvar="TETHER_STORE",
        help="Store URL: a folder, file://PATH, memory://NAME or s3://BUCKET/PREFIX.",
    ),
]
RunOption = Annotated[str | None, typer.Option("--run", help="Run id.")]
VersionOption = Annotated[int | None, typer.Option("--version", min=0, help="Version number.")]
IdentityArgument = Annotated[
    str | None, typer.Argument(help="A version as RUN/weight_vNNNNNN (or use --run/--version).")
]


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    errors.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the store's input errors into one line and exit code 2 (no traceback)."""
    from store.errors import AlreadyExists, InvalidName, InvalidVersion, StoreError, VersionNotFound

    try:
        yield
    except (InvalidName, InvalidVersion, VersionNotFound, AlreadyExists) as exc:
        raise fail(str(exc)) from None
    except StoreError as exc:
        raise fail(f"{type(exc).__name__}: {exc}", EXIT_PROBLEM) from None


def open_store(url: str) -> Store:
    """Open `url`; a local folder must already exist (a typo should not look like no runs)."""
    from store.objects.local import LocalObjects
    from store.settings import StoreSettings
    from store.store import Store

    store = Store(url, cache_dir=StoreSettings().cache_dir)
    if isinstance(store.objects, LocalObjects) and not store.objects.root.is_dir():
        raise fail(
            f"no store at {store.objects.root}; pass --store URL or set TETHER_STORE "
            f"(default {DEFAULT_STORE_URL})"
        )
    return store


def resolve_ref(identity: str | None, run: str | None, version: int | None) -> VersionRef:
    from store.types import VersionRef

    if identity is not None:
        if run is not None or version is not None:
            raise fail("give either RUN/weight_vNNNNNN or --run/--version, not both")
        return VersionRef.parse(identity)
    if run is None or version is None:
        raise fail("name a version: RUN/weight_vNNNNNN, or --run RUN --version N")
    return VersionRef(run, version)


def human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"


def versions_table(store: Store, run_id: str) -> Table:
    """A run's versions: version, kind, base, encoding, bytes, files and the pointer marker."""
    pointer = store.read_pointer(run_id)
    table = Table(title=f"{run_id} in {store.url}")
    for column in ("version", "kind", "base", "encoding", "bytes", "files", ""):
        table.add_column(column, justify="right" if column in {"version", "bytes"} else "left")
    for info in store.version_infos(run_id):
        marker = "← latest" if pointer == info.ref else ("incomplete" if not info.complete else "")
        table.add_row(
            str(info.ref.version),
            str(info.kind or "?"),
            "-" if info.base_version is None else str(info.base_version),
            (info.manifest.delta_encoding or "-") if info.manifest else "?",
            human_bytes(info.bytes),
            str(len(info.version_files) or len(info.sizes)),
            marker,
        )
    return table


def runs_table(store: Store) -> Table:
    table = Table(title=f"runs in {store.url}")
    for column in ("run", "latest", "versions", "boot", "dtype", "created"):
        table.add_column(column)
    for run_id in store.list_runs():
        info = store.read_run(run_id)
        pointer = store.read_pointer(run_id)
        table.add_row(
            run_id,
            "-" if pointer is None else str(pointer.version),
            str(len(store.list_versions(run_id))),
            str(info.boot_version),
            info.canonical_dtype,
            info.created or "-",
        )
    return table


@app.command("ls")
def list_command(store_url: StoreOption = DEFAULT_STORE_URL, run: RunOption = None) -> None:
    """List runs, or the versions of one run (--run) with the pointer marked."""
    with user_errors():
        store = open_store(store_url)
        if run is None:
            console.print(runs_table(store))
        else:
            store.read_run(run)
            console.print(versions_table(store, run))


@app.command("show")
def show_command(
    identity: IdentityArgument = None,
    store_url: StoreOption = DEFAULT_STORE_URL,
    run: RunOption = None,
    version: VersionOption = None,
) -> None:
    """Show one version's manifest: metadata, shards and tensor count."""
    with user_errors():
        store = open_store(store_url)
        ref = resolve_ref(identity, run, version)
        store.read_run(ref.run_id)
        manifest = store.read_manifest(ref)
        info = next((i for i in store.version_infos(ref.run_id) if i.ref == ref), None)
        meta = Table(title=ref.identity, show_header=False, min_width=len(ref.identity) + 4)
        meta.add_column("field")
        meta.add_column("value")
        rows = {
            "kind": str(manifest.kind),
            "base_version": manifest.base_version,
            "delta_encoding": manifest.delta_encoding,
            "compression_format": manifest.compression_format,
            "checksum_format": manifest.checksum_format,
            "total_size": manifest.total_size or None,
            "tensors": len(manifest.weight_map),
            "complete": info.complete if info else False,
            "latest": store.read_pointer(ref.run_id) == ref,
        }
        for field, value in rows.items():
            meta.add_row(field, "-" if value is None else str(value))
        console.print(meta)
        shards = Table(title="files")
        shards.add_column("file")
        shards.add_column("bytes", justify="right")
        shards.add_column("tensors", justify="right")
        sizes = info.sizes if info else {}
        for shard in manifest.shard_files():
            count = sum(1 for s in manifest.weight_map.values() if s == shard)
            size = sizes.get(shard)
            shards.add_row(shard, "missing" if size is None else human_bytes(size), str(count))
        console.print(shards)


@contextmanager
def progress_bar() -> Iterator[Callable[[int, int, str], None]]:
    """A Rich progress bar fed by the store's `progress(done, total, what)` callbacks."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("starting", total=None)

        def update(done: int, total: int, what: str) -> None:
            progress.update(task, completed=done, total=total, description=what)

        yield update


@app.command("verify")
def verify_command(
    identity: IdentityArgument = None,
    store_url: StoreOption = DEFAULT_STORE_URL,
    run: RunOption = None,
    version: VersionOption = None,
) -> None:
    """Check every file and tensor checksum of a version (or of every version of --run)."""
    from store.types import VersionRef

    with user_errors():
        store = open_store(store_url)
        if identity is None and version is None and run is not None:
            store.read_run(run)
            refs = [VersionRef(run, v) for v in store.list_versions(run)]
            if not refs:
                raise fail(f"run {run!r} has no complete versions to verify")
        else:
            refs = [resolve_ref(identity, run, version)]
            store.read_run(refs[0].run_id)
        problems: list[str] = []
        checked = 0
        with progress_bar() as update:
            for ref in refs:
                report = store.verify(ref, progress=update)
                problems += report.problems
                checked += report.tensors_checked
        for problem in problems:
            errors.print(f"[red]problem:[/red] {problem}", highlight=False, soft_wrap=True)
        if problems:
            raise typer.Exit(EXIT_PROBLEM)
        console.print(f"ok: {len(refs)} version(s), {checked} tensor checksums verified")


@app.command("gc")
def gc_command(
    run: Annotated[str, typer.Option("--run", help="Run id.")],
    keep: Annotated[int, typer.Option("--keep", min=1, help="Newest versions to keep.")],
    store_url: StoreOption = DEFAULT_STORE_URL,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report what would be deleted; delete nothing.")
    ] = False,
) -> None:
    """Delete old versions; keep the newest N, the pointer's, and every anchor they need."""
    with user_errors():
        store = open_store(store_url)
        report = store.gc(run, keep=keep, dry_run=dry_run)
        verb = "would delete" if dry_run else "deleted"
        console.print(
            f"{verb} versions {report.deleted or 'none'}"
            + (f" and incomplete {report.incomplete_deleted}" if report.incomplete_deleted else "")
            + f" ({human_bytes(report.bytes_freed)}); kept {report.kept}"
        )


@app.command("publish")
def publish_command(
    run: Annotated[str, typer.Option("--run", help="Run id (created on first publish).")],
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", help="Hugging Face checkpoint folder to publish.")
    ],
    store_url: StoreOption = DEFAULT_STORE_URL,
    control_plane: Annotated[
        str | None,
        typer.Option(
            "--control-plane",
            envvar="TETHER_CONTROL_PLANE",
            help="Control plane to create the run at and notify (optional).",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="TETHER_TOKEN", help="Trainer-role bearer token."),
    ] = None,
) -> None:
    """Publish a checkpoint as the run's next version; the first publish creates the run
    (in the store and at the control plane) with the checkpoint as its boot version 0."""
    import httpx

    from trainer_client.notifier import ControlPlaneRefused
    from trainer_client.publisher import Publisher

    if not (checkpoint / "config.json").is_file():
        raise fail(f"--checkpoint {checkpoint} has no config.json (a Hugging Face folder)")
    with user_errors():
        publisher = Publisher(store_url, run, control_plane, token, progress=False)
        try:
            report = publisher.claim(0, checkpoint) or publisher.publish(checkpoint)
        except ControlPlaneRefused as exc:  # a bad token, a store outside its roots
            raise fail(str(exc), EXIT_PROBLEM) from None
        except httpx.TransportError as exc:
            raise fail(f"cannot reach the control plane at {control_plane}: {exc}") from None
        finally:
            publisher.close()
    console.print(f"published {run} v{report.version} ({report.kind.value}) to {store_url}")
