"""The Modal backend, offline: its request, its result mapping, its errors, its cleanup."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandboxes.base import SandboxSpec
from sandboxes.errors import ModalCredentialsMissing, ModalUnavailable, SandboxFailure
from sandboxes.limits import Limits
from sandboxes.modal_backend import (
    ModalSandbox,
    build_request,
    map_exec_result,
    modal_credentials_configured,
)


class FakeStream:
    def __init__(self, data: bytes = b"") -> None:
        self.data, self.written, self.eof = data, b"", False

    def read(self) -> bytes:
        return self.data

    def write(self, data: bytes) -> None:
        self.written += data

    def write_eof(self) -> None:
        self.eof = True

    def drain(self) -> None:
        pass


class FakeProcess:
    """Mimics modal.container_process.ContainerProcess: streams, then wait() -> returncode."""

    def __init__(self, returncode: int, stdout: bytes, stderr: bytes) -> None:
        self.stdout, self.stderr, self.stdin = FakeStream(stdout), FakeStream(stderr), FakeStream()
        self._returncode = returncode

    def wait(self) -> int:
        return self._returncode


class FakeModalSandbox:
    def __init__(self, script: list[tuple[int, bytes, bytes]]) -> None:
        self.script, self.execs, self.terminated, self.detached = script, [], False, False

    def exec(self, *argv: str, **kwargs: object) -> FakeProcess:
        self.execs.append((argv, kwargs))
        returncode, out, err = self.script.pop(0) if self.script else (0, b"", b"")
        process = FakeProcess(returncode, out, err)
        self.last = process
        return process

    def terminate(self) -> None:
        self.terminated = True

    def detach(self) -> None:
        self.detached = True


def fake_modal(script: list[tuple[int, bytes, bytes]]) -> SimpleNamespace:
    created: list[tuple[tuple[str, ...], dict[str, object]]] = []
    lookups: list[str] = []
    sandbox = FakeModalSandbox(script)

    def create(*args: str, **kwargs: object) -> FakeModalSandbox:
        created.append((args, kwargs))
        return sandbox

    def from_registry(tag: str) -> SimpleNamespace:
        return SimpleNamespace(entrypoint=lambda argv: ("image", tag, tuple(argv)))

    def lookup(name: str, create_if_missing: bool = False) -> str:
        lookups.append(name)
        return f"app:{name}"

    return SimpleNamespace(
        App=SimpleNamespace(lookup=lookup),
        Image=SimpleNamespace(from_registry=from_registry),
        Sandbox=SimpleNamespace(create=create),
        created=created,
        lookups=lookups,
        sandbox=sandbox,
    )


def test_the_request_blocks_the_network_and_outlives_the_longest_command():
    spec = SandboxSpec(image="ghcr.io/x/y:1", cpu=2.0, memory_mib=2048, timeout_s=100.5)
    request = build_request(spec, "my-app")
    assert request.create_kwargs() == {
        "timeout": 401,
        "workdir": "/tether/work",
        "cpu": 2.0,
        "memory": 2048,
        "block_network": True,
    }
    assert request.command == ("sleep", "infinity")
    assert build_request(SandboxSpec(network=True)).block_network is False


def test_a_sandbox_is_created_from_the_request_and_cleaned_up_on_exit():
    modal = fake_modal([])
    spec = SandboxSpec(image="python:3.12-slim", extra_dirs=("report",))
    with ModalSandbox(spec, app_name="t-app", modal_module=modal) as sandbox:
        assert sandbox.dir("report") == "/tether/report"
    ((args, kwargs),) = modal.created
    assert args == ("sleep", "infinity")
    assert kwargs["app"] == "app:t-app" and kwargs["block_network"] is True
    assert kwargs["image"] == ("image", "python:3.12-slim", ())
    assert modal.sandbox.execs[0][0] == ("mkdir", "-p", "/tether/report")
    assert modal.sandbox.terminated and modal.sandbox.detached


def test_exec_passes_stdin_and_maps_output_and_exit_code():
    modal = fake_modal([(3, b"out", b"err")])
    with ModalSandbox(SandboxSpec(), modal_module=modal) as sandbox:
        result = sandbox.exec(["cat"], stdin=b"payload", timeout_s=7.2, env={"A": "1"})
        process = modal.sandbox.last
    argv, kwargs = modal.sandbox.execs[0]
    assert argv == ("cat",) and kwargs["timeout"] == 8 and kwargs["env"] == {"A": "1"}
    assert process.stdin.written == b"payload" and process.stdin.eof
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (
        3,
        b"out",
        b"err",
        False,
    )


def test_an_exec_timeout_reported_as_minus_one_is_a_timeout():
    result = map_exec_result(-1, "partial", "", keep_bytes=100, cap_bytes_total=1000, duration_s=1)
    assert result.timed_out and result.exit_code == 124 and result.stdout == b"partial"


def test_huge_modal_output_is_capped_like_local_output():
    spec = SandboxSpec(limits=Limits(output_cap_bytes=1000, output_keep_bytes=100))
    modal = fake_modal([(0, b"z" * 5000, b"")])
    with ModalSandbox(spec, modal_module=modal) as sandbox:
        result = sandbox.exec(["yes"])
    assert result.output_limited and result.stdout_truncated and len(result.stdout) < 300


def test_file_writes_go_over_exec_stdin():
    modal = fake_modal([])
    with ModalSandbox(SandboxSpec(), modal_module=modal) as sandbox:
        sandbox.write_file("a/b.txt", b"hi")
        process = modal.sandbox.last
    assert process.stdin.written == b"hi"
    assert modal.sandbox.execs[-1][0][-1] == "/tether/work/a/b.txt"


def test_a_broken_transport_is_a_sandbox_failure():
    modal = fake_modal([])

    def explode(*argv: str, **kwargs: object) -> None:
        raise ConnectionError("stream reset")

    with ModalSandbox(SandboxSpec(), modal_module=modal) as sandbox:
        modal.sandbox.exec = explode
        with pytest.raises(SandboxFailure, match="stream reset"):
            sandbox.exec(["true"])


def test_without_the_modal_package_the_backend_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)  # import modal -> ImportError
    with pytest.raises(ModalUnavailable, match=r"tether\[modal\]"):
        ModalSandbox(SandboxSpec())


def test_missing_credentials_are_reported_before_anything_is_created(monkeypatch, tmp_path: Path):
    assert not modal_credentials_configured(env={}, home=tmp_path)
    assert modal_credentials_configured(
        env={"MODAL_TOKEN_ID": "a", "MODAL_TOKEN_SECRET": "b"}, home=tmp_path
    )
    (tmp_path / ".modal.toml").write_text("[default]\n")
    assert modal_credentials_configured(env={}, home=tmp_path)
    monkeypatch.setitem(sys.modules, "modal", fake_modal([]))
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "empty-home"))
    with pytest.raises(ModalCredentialsMissing, match="MODAL_TOKEN_ID"):
        ModalSandbox(SandboxSpec())
