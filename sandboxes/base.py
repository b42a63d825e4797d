"""The `Sandbox` port: one isolated place to write files into, run commands in, read back.

Owns the interface and its value types (`SandboxSpec`, `ExecResult`) plus the file
operations every backend gets for free by running `tar`, `cat` and `mkdir` through `exec`
(so files always cross the isolation boundary as the sandboxed user and never by a host
path the sandbox could have redirected with a symlink). It must never decide rewards.
"""

from __future__ import annotations

import io
import posixpath
import sys
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from sandboxes.errors import SandboxFailure
from sandboxes.limits import Limits


@dataclass(frozen=True)
class SandboxSpec:
    """What to create. Backends ignore the fields that have no meaning to them.

    `image` is a container image for remote backends; the local backend shares the host's
    read-only root instead. `extra_dirs` names writable folders besides the work folder that
    persist between commands (e.g. a report folder outside the repository).
    """

    image: str = ""
    cpu: float = 1.0
    memory_mib: int = 4096
    timeout_s: float = 600.0
    network: bool = False
    python: str = field(default_factory=lambda: sys.executable)
    limits: Limits = field(default_factory=Limits)
    extra_dirs: tuple[str, ...] = ()
    hidden_paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command. Output is capped: head and tail kept, middle counted."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    output_limited: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_limited

    def describe(self) -> str:
        """One line for error messages: exit status and the end of stderr."""
        what = "timed out" if self.timed_out else f"exit code {self.exit_code}"
        if self.output_limited:
            what += ", output cap hit"
        tail = self.stderr[-600:].decode(errors="replace").strip()
        return f"{what}: {tail}" if tail else what


class Sandbox(ABC):
    """An isolated work folder plus a way to run commands in it; closing kills everything.

    Paths given to the file methods are absolute inside the sandbox or relative to
    `workdir`. `isolation` names how strongly commands are isolated ("none" when not).
    """

    workdir: str
    isolation: str

    @abstractmethod
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
        """Run `argv` to completion or until `timeout_s`, whichever comes first."""

    @abstractmethod
    def dir(self, name: str) -> str:
        """The in-sandbox path of the extra folder `name` from `SandboxSpec.extra_dirs`."""

    @abstractmethod
    def terminate(self) -> None:
        """Kill whatever still runs and release the sandbox; safe to call twice."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.terminate()

    def resolve(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.workdir, path)

    def write_file(self, path: str, data: bytes) -> None:
        """Create or replace one file (parents created) as the sandboxed user."""
        target = self.resolve(path)
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        result = self.exec(["sh", "-c", script, "sh", target], stdin=data, timeout_s=60)
        if not result.ok:
            raise SandboxFailure(f"could not write {target} in the sandbox: {result.describe()}")

    def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """The bytes of one file; `FileNotFoundError` when it is absent."""
        target = self.resolve(path)
        script = 'test -f "$1" || exit 3; head -c "$2" -- "$1"'
        cap = max_bytes + 1
        result = self.exec(
            ["sh", "-c", script, "sh", target, str(cap)], timeout_s=60, output_cap_bytes=cap
        )
        if result.exit_code == 3 and not result.timed_out:
            raise FileNotFoundError(target)
        if not result.ok or result.stdout_truncated:
            raise SandboxFailure(f"could not read {target} in the sandbox: {result.describe()}")
        if len(result.stdout) > max_bytes:
            raise SandboxFailure(f"{target} is larger than {max_bytes} bytes; refusing to read it")
        return result.stdout

    def upload_tree(self, local_dir: Path, dest: str | None = None) -> None:
        """Copy a host folder into the sandbox (tar over the command's stdin)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for child in sorted(Path(local_dir).iterdir()):
                archive.add(child, arcname=child.name)
        target = self.resolve(dest or self.workdir)
        script = 'mkdir -p -- "$1" && tar -x --no-same-owner -f - -C "$1"'
        result = self.exec(
            ["sh", "-c", script, "sh", target], stdin=buffer.getvalue(), timeout_s=300
        )
        if not result.ok:
            raise SandboxFailure(f"could not upload {local_dir} to {target}: {result.describe()}")
