"""The Modal backend: a `modal.Sandbox` with its network blocked, behind the `Sandbox` port.

`modal` is imported lazily, only when a sandbox is created, so this module imports (and its
request building and result mapping are tested) without the package or credentials. The
request is plain data (`ModalRequest`); `map_exec_result` turns what Modal returns into an
`ExecResult`. Files cross via tar/cat over exec stdin (the base class), which works on every
modal 1.x (the `Sandbox.open` file API is gone in 1.6). This module never falls back to
local execution: without Modal it raises.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from sandboxes.base import ExecResult, Sandbox, SandboxSpec
from sandboxes.errors import ModalCredentialsMissing, ModalUnavailable, SandboxFailure
from sandboxes.output import cap_bytes

MODAL_WORKDIR = "/tether/work"
EXEC_TIMEOUT_RETURNCODE = -1  # what ContainerProcess.wait() reports when exec timeout hits
LIFETIME_MARGIN_S = 300
_app_cache: dict[str, Any] = {}
_app_lock = threading.Lock()


@dataclass(frozen=True)
class ModalRequest:
    """Everything `modal.Sandbox.create` is called with, as plain data."""

    image: str
    app_name: str
    cpu: float
    memory_mib: int
    timeout_s: int
    workdir: str = MODAL_WORKDIR
    block_network: bool = True
    command: tuple[str, ...] = ("sleep", "infinity")
    tags: dict[str, str] = field(default_factory=dict)

    def create_kwargs(self) -> dict[str, Any]:
        return {
            "timeout": self.timeout_s,
            "workdir": self.workdir,
            "cpu": self.cpu,
            "memory": self.memory_mib,
            "block_network": self.block_network,
        }


def build_request(spec: SandboxSpec, app_name: str = "tether-sandboxes") -> ModalRequest:
    """The Modal request for `spec`; the sandbox outlives its longest command by a margin."""
    return ModalRequest(
        image=spec.image or "python:3.11-slim",
        app_name=app_name,
        cpu=spec.cpu,
        memory_mib=spec.memory_mib,
        timeout_s=math.ceil(spec.timeout_s) + LIFETIME_MARGIN_S,
        block_network=not spec.network,
        tags={"owner": "tether"},
    )


def modal_credentials_configured(
    env: Mapping[str, str] | None = None, home: Path | None = None
) -> bool:
    """True when MODAL_TOKEN_ID and MODAL_TOKEN_SECRET are set or ~/.modal.toml exists."""
    env = os.environ if env is None else env
    if env.get("MODAL_TOKEN_ID") and env.get("MODAL_TOKEN_SECRET"):
        return True
    return ((home or Path.home()) / ".modal.toml").is_file()


def import_modal() -> ModuleType:
    try:
        import modal
    except ImportError:
        raise ModalUnavailable(
            "the Modal backend needs the `modal` package: pip install 'tether[modal]'"
        ) from None
    return modal


def map_exec_result(
    returncode: int,
    stdout: bytes | str,
    stderr: bytes | str,
    *,
    keep_bytes: int,
    cap_bytes_total: int,
    duration_s: float,
) -> ExecResult:
    """An `ExecResult` from what a finished Modal process reports.

    Modal does not raise when an exec's timeout passes: `wait()` returns -1, mapped here to
    `timed_out` and exit code 124 as `timeout(1)` would give. Signals arrive as 128 + n.
    """
    out = stdout.encode() if isinstance(stdout, str) else stdout
    err = stderr.encode() if isinstance(stderr, str) else stderr
    timed_out = returncode == EXEC_TIMEOUT_RETURNCODE
    out_kept, out_cut = cap_bytes(out, keep_bytes)
    err_kept, err_cut = cap_bytes(err, keep_bytes)
    return ExecResult(
        exit_code=124 if timed_out else returncode,
        stdout=out_kept,
        stderr=err_kept,
        stdout_truncated=out_cut,
        stderr_truncated=err_cut,
        timed_out=timed_out,
        output_limited=len(out) + len(err) > cap_bytes_total,
        duration_s=duration_s,
    )


class ModalSandbox(Sandbox):
    """A Modal Sandbox. `modal_module` lets tests pass an offline stand-in for `modal`."""

    isolation = "modal"

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        *,
        app_name: str = "tether-sandboxes",
        modal_module: ModuleType | Any | None = None,
    ) -> None:
        self.spec = spec or SandboxSpec()
        if modal_module is None:
            modal_module = import_modal()
            if not modal_credentials_configured():
                raise ModalCredentialsMissing(
                    "no Modal credentials: set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET or run "
                    "`modal token new` (writes ~/.modal.toml); or use the local backend"
                )
        self._modal = modal_module
        self.request = build_request(self.spec, app_name)
        self.workdir = self.request.workdir
        self._dirs = {name: f"/tether/{name}" for name in self.spec.extra_dirs}
        self._terminated = False
        try:
            app = self._app()
            image = self._modal.Image.from_registry(self.request.image).entrypoint([])
            self._sandbox = self._modal.Sandbox.create(
                *self.request.command, app=app, image=image, **self.request.create_kwargs()
            )
        except Exception as error:  # any Modal failure here is infrastructure
            raise SandboxFailure(f"could not create a Modal sandbox: {error}") from error
        if self._dirs:
            made = self.exec(["mkdir", "-p", *self._dirs.values()], timeout_s=60)
            if not made.ok:
                raise SandboxFailure(f"could not create sandbox folders: {made.describe()}")

    def _app(self) -> Any:
        # App.lookup is a network round trip; one per app name per process.
        with _app_lock:
            key = f"{id(self._modal)}:{self.request.app_name}"
            if key not in _app_cache:
                _app_cache[key] = self._modal.App.lookup(
                    self.request.app_name, create_if_missing=True
                )
            return _app_cache[key]

    def dir(self, name: str) -> str:
        try:
            return self._dirs[name]
        except KeyError:
            raise KeyError(f"no folder {name!r}; declare it in SandboxSpec.extra_dirs") from None

    def exec(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        output_cap_bytes: int | None = None,
    ) -> ExecResult:
        if self._terminated:
            raise SandboxFailure("this sandbox is terminated; create a new one")
        timeout = timeout_s if timeout_s is not None else self.spec.timeout_s
        started = time.monotonic()
        try:
            process = self._sandbox.exec(
                *argv,
                workdir=self.resolve(workdir) if workdir else self.workdir,
                env=dict(env or {}),
                timeout=max(1, math.ceil(timeout)),
                text=False,
            )
            if stdin is not None:
                process.stdin.write(stdin)
                process.stdin.write_eof()
                process.stdin.drain()
            stdout = process.stdout.read()
            stderr = process.stderr.read()
            returncode = process.wait()
        except Exception as error:  # transport failures are infrastructure, not output
            raise SandboxFailure(f"Modal exec of {argv[0]!r} failed: {error}") from error
        limits = self.spec.limits
        return map_exec_result(
            returncode,
            stdout,
            stderr,
            keep_bytes=output_cap_bytes or limits.output_keep_bytes,
            cap_bytes_total=output_cap_bytes or limits.output_cap_bytes,
            duration_s=time.monotonic() - started,
        )

    def terminate(self) -> None:
        if self._terminated:
            return
        self._terminated = True
        self._sandbox.terminate()
        detach = getattr(self._sandbox, "detach", None)
        if detach is not None:  # modal >= 1.3.4
            detach()
