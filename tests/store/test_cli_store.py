"""`tether store ls|show|verify|gc`: output, exit codes, and no tracebacks for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.store import app
from store.store import Store
from store.types import VersionRef
from tests.store.chain import publish_chain

runner = CliRunner()


@pytest.fixture
def local_store(tmp_path: Path) -> Store:
    store = Store(str(tmp_path / "store"))
    publish_chain(store, "run-a", "FDDFD")
    return store


def invoke(store: Store | str, *args: str):
    url = store if isinstance(store, str) else store.url
    return runner.invoke(app, [*args, "--store", url], env={"COLUMNS": "200"})


def test_ls_lists_runs_and_a_runs_versions_with_the_pointer_marked(local_store: Store) -> None:
    runs = invoke(local_store, "ls")
    assert runs.exit_code == 0, runs.output
    assert "run-a" in runs.output
    versions = invoke(local_store, "ls", "--run", "run-a")
    assert versions.exit_code == 0, versions.output
    rows = [line for line in versions.output.splitlines() if "delta" in line or "full" in line]
    assert len(rows) == 5
    assert "latest" in rows[-1] and all("latest" not in row for row in rows[:-1])


def test_show_prints_a_versions_manifest_either_way_of_naming_it(local_store: Store) -> None:
    by_identity = invoke(local_store, "show", "run-a/weight_v000002")
    by_flags = invoke(local_store, "show", "--run", "run-a", "--version", "2")
    assert by_identity.exit_code == 0 and by_flags.exit_code == 0, by_identity.output
    assert by_identity.output == by_flags.output
    assert "base_version" in by_identity.output and "sparse" in by_identity.output


def test_verify_passes_an_intact_run_and_fails_a_damaged_one(local_store: Store) -> None:
    ok = invoke(local_store, "verify", "--run", "run-a")
    assert ok.exit_code == 0, ok.output
    assert "ok: 5 version(s)" in ok.output
    shard = local_store.read_manifest(VersionRef("run-a", 3)).shard_files()[0]
    key = f"run-a/updates/weight_v000003/{shard}"
    data = bytearray(local_store.objects.get(key))
    data[-1] ^= 0xFF
    local_store.objects.put(key, bytes(data))
    bad = invoke(local_store, "verify", "run-a/weight_v000003")
    assert bad.exit_code == 1
    assert "problem" in bad.output


def test_gc_dry_run_then_for_real(local_store: Store) -> None:
    dry = invoke(local_store, "gc", "--run", "run-a", "--keep", "1", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would delete versions [0, 1, 2]" in dry.output
    assert local_store.list_versions("run-a") == [0, 1, 2, 3, 4]
    real = invoke(local_store, "gc", "--run", "run-a", "--keep", "1")
    assert real.exit_code == 0 and "deleted versions [0, 1, 2]" in real.output
    assert local_store.list_versions("run-a") == [3, 4]


@pytest.mark.parametrize(
    "args",
    [
        ("ls", "--run", "no-such-run"),
        ("show", "run-a/weight_v000099"),
        ("show", "not-an-identity"),
        ("show", "--run", "run-a"),
        ("verify", "--run", "../etc"),
        ("gc", "--run", "no-such-run", "--keep", "1"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(local_store: Store, args: tuple) -> None:
    result = invoke(local_store, *args)
    assert result.exit_code == 2, result.output
    assert "error" in result.output.lower()
    assert "Traceback" not in result.output


@pytest.mark.parametrize("url", ["gs://bucket/x", "/definitely/not/a/store"])
def test_a_bad_store_url_exits_2(url: str) -> None:
    result = invoke(url, "ls")
    assert result.exit_code == 2
    assert "error" in result.output


def test_every_command_has_help() -> None:
    for command in ("ls", "show", "verify", "gc"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "--store" in result.output
