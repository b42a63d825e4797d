"""Child processes of the demo: start them, wait until they answer, and always stop them.

Owns process lifetimes only. Each child runs in its own session (process group), its output
goes to a log file, and `ProcessGroup.stop_all` terminates every group it started (SIGTERM,
then SIGKILL after a grace period), newest first, so nothing outlives the demo, on success,
on error or on Ctrl-C; on Linux a child also gets SIGTERM if the demo itself is killed.
It never interprets what a child does beyond "does this URL answer".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

import httpx

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class ProcessFailed(RuntimeError):
    """A child exited or did not become ready in time; the message quotes its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


@dataclass
class ManagedProcess:
    """One child: its name, process, log file and (optionally) the URL it serves."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_http(
        self, path: str, deadline_s: float, ok: Callable[[int], bool] | None = None
    ) -> None:
        """Poll `url + path` until it answers 200 (or `ok(status)`), the child dies, or the
        deadline passes (then `ProcessFailed`)."""
        assert self.url is not None, f"{self.name} serves no URL"
        accept = ok or (lambda status: status == 200)
        end = time.monotonic() + deadline_s
        while True:
            if not self.alive():
                raise ProcessFailed(
                    f"{self.name} exited with {self.process.returncode} before it was ready; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                if accept(httpx.get(self.url + path, timeout=2.0).status_code):
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                raise ProcessFailed(
                    f"{self.name} did not answer {self.url}{path} within {deadline_s:.0f}s; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.1)  # polling interval while a child starts, bounded by the deadline

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the child's group and wait up to `grace_s`, then SIGKILL it."""
        self.terminate()
        self.finish(time.monotonic() + grace_s)

    def terminate(self) -> None:
        """SIGTERM the child's process group (no wait)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Wait for the child until `deadline` (monotonic), then SIGKILL its group."""
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.info("%s still running after SIGTERM; killing it", self.name)
        # The group may hold grandchildren even after the leader exited.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


@dataclass
class ProcessGroup:
    """Every child the demo started; a context manager that stops them all on exit.

    While open, SIGTERM is turned into `KeyboardInterrupt` so a terminated demo cleans up
    exactly like one interrupted with Ctrl-C.
    """

    log_dir: Path
    children: list[ManagedProcess] = field(default_factory=list)
    _previous_sigterm: object = None

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        url: str | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """Start `argv` in its own session, output to `<log_dir>/<name>.log`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as out:
            process = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        child = ManagedProcess(name, process, log_path, url)
        self.children.append(child)
        log.info("started %s (pid %d): %s", name, process.pid, " ".join(argv))
        return child

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child (newest first: agents deregister before their engines go),
        wait up to `grace_s` for all of them together, then SIGKILL what is left."""
        for child in reversed(self.children):
            child.terminate()
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            child.finish(deadline)

    def __enter__(self) -> ProcessGroup:
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        with contextlib.suppress(ValueError):  # not the main thread: leave SIGTERM alone
            signal.signal(signal.SIGTERM, _interrupt)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A second Ctrl-C while stopping must not leave children behind.
        previous_int = signal.getsignal(signal.SIGINT)
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.stop_all()
        finally:
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGINT, previous_int)
                signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the demo dies, even by
    SIGKILL, when no `finally` can run. A no-op where prctl does not exist."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
