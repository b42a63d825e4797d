"""Child processes: start them, wait until they answer, and always stop their whole tree.

Owns process lifetimes only, for the demo, the Modal replicas, the GPU check and the tests:

- `start_process` runs a command in its own session (so its process group holds every
  grandchild), output to a log file; on Linux the child also gets SIGTERM if the starter
  dies, even by SIGKILL, when no `finally` can run;
- `ManagedProcess.wait_http` polls the child's URL until it answers, the child dies or a
  deadline passes (then `ProcessFailed`, quoting the log's tail, with the child stopped);
- `ManagedProcess.stop` ends the group: SIGTERM, then SIGKILL after a grace period;
- `ProcessGroup` is the registry of what one owner started: on leaving its `with` block
  (success, error, Ctrl-C or SIGTERM) it stops every child, newest first, and the children
  the others call (a control plane) only once the others have exited;
- `wait_until` polls any condition with a deadline; `free_port` picks a loopback port
  (below the kernel's ephemeral range, so no outgoing connection takes it meanwhile);
- `pin` keeps a process tree on some CPUs (a benchmark giving a server cores of its own).

It never interprets what a child does beyond "does this URL answer" and "has it exited".
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TypeVar

import httpx

log = logging.getLogger(__name__)

TETHER = str(Path(sys.executable).with_name("tether"))
"""The `tether` command installed beside this interpreter."""

POLL_S = 0.05
_PR_SET_PDEATHSIG = 1

T = TypeVar("T")


class ProcessFailed(RuntimeError):
    """A child exited or did not become ready in time; the message quotes its log's tail."""


class DeadlineExceeded(TimeoutError):
    """A condition polled by `wait_until` did not hold before its deadline."""


# Where `free_ports` looks when the kernel's ephemeral range cannot be read (Linux's default).
_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST_PORT = 10000
# Ports this process has handed out: never twice, even once free again.
_handed_out: set[int] = set()
_ports_lock = threading.Lock()
_pick = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that are free right now, never handed out
    before by this process. Another process may still take one before the server binds it,
    so they are drawn at random from below the kernel's ephemeral range: a port the kernel
    picks itself (bind to port 0) is also what it gives the next outgoing connection as its
    source port, and a fresh-clone run lost a test to exactly that ("address already in
    use" on an engine's port). Where no such range is left, the kernel picks."""
    below = _ephemeral_range()[0] - 1
    tries = 100 * count if below > _LOWEST_PORT else 0
    ports: list[int] = []
    with _ports_lock:
        for _ in range(tries):
            if len(ports) == count:
                break
            port = _pick.randint(_LOWEST_PORT, below)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                ports.append(port)
        while len(ports) < count:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                ports.append(port)
    return ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (`free_ports`)."""
    return free_ports(1)[0]


def parse_cpus(text: str) -> set[int]:
    """The CPUs of a list such as `0`, `0,2` or `0-3,6` (as `taskset -c` reads it); a
    `ValueError` naming the part that is not one, or a CPU this process may not run on."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, _, last = part.partition("-")
        try:
            cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(
                f"{part!r} in CPU list {text!r} is not a CPU number or range (e.g. 0 or 0-3)"
            ) from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(
            f"CPU list {text!r} names CPUs this process may not run on; it may use "
            f"{sorted(allowed)}"
        )
    return cpus


def pin(pid: int, cpus: set[int]) -> int:
    """Run process `pid`, every thread it has and every process below it on `cpus` only;
    threads and processes they start later inherit it. Returns how many threads were
    pinned (those that exit meanwhile are skipped). Needs psutil (the dev extra: only
    benchmarks pin)."""
    import psutil

    root = psutil.Process(pid)
    pinned = 0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for thread in process.threads():
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(thread.id, cpus)
                    pinned += 1
    return pinned


def log_tail(path: Path, chars: int = 3000) -> str:
    """The last `chars` characters of a log file, or a note that there is none."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def wait_until(
    predicate: Callable[[], T | None], deadline_s: float, what: str, interval_s: float = POLL_S
) -> T:
    """Return `predicate()`'s first truthy value; raise `DeadlineExceeded` naming `what`
    after `deadline_s` seconds. Exceptions from `predicate` propagate at once."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise DeadlineExceeded(f"timed out after {deadline_s:g}s waiting for {what}")
        time.sleep(interval_s)  # polling interval, bounded by the deadline


@dataclass
class ManagedProcess:
    """One child: its name, process, log file and (optionally) the URL it serves."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    def wait_http(
        self,
        path: str = "/health",
        deadline_s: float = 60.0,
        ready: Callable[[httpx.Response], bool] | None = None,
        interval_s: float = 0.1,
    ) -> ManagedProcess:
        """Poll `url + path` every `interval_s` until it answers 200 (or as `ready` wants).
        If the child exits first or the deadline passes, stop it and raise `ProcessFailed`."""
        url = self.url
        if url is None:
            raise ValueError(f"{self.name} was started without a URL; pass url= to wait on it")
        accept = ready or (lambda reply: reply.status_code == 200)

        def answers() -> bool:
            if not self.alive():
                raise ProcessFailed(
                    f"{self.name} exited with {self.process.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                return accept(httpx.get(url + path, timeout=2.0))
            except httpx.TransportError:
                return False

        try:
            wait_until(answers, deadline_s, f"{self.name} at {self.url}{path}", interval_s)
        except DeadlineExceeded:
            self.stop()
            raise ProcessFailed(
                f"{self.name} did not answer {self.url}{path} within {deadline_s:g}s; "
                f"log {self.log_path}:\n{self.log_tail()}"
            ) from None
        except ProcessFailed:
            self.stop()
            raise
        return self

    def terminate(self) -> None:
        """SIGTERM the child's process group (no wait)."""
        if self.alive():
            self._signal(signal.SIGTERM)

    def finish(self, deadline: float) -> int | None:
        """Wait for the child until `deadline` (monotonic), then SIGKILL its group;
        return its exit code."""
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.info("%s still running after SIGTERM; killing it", self.name)
        # The group may hold grandchildren even after the leader exited.
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        return self.process.returncode

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, SIGKILL it after `grace_s`; return the exit code."""
        self.terminate()
        return self.finish(time.monotonic() + grace_s)

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, for fault tests)."""
        self._signal(signal.SIGKILL)
        self.process.wait(10)

    def wait_exit(self, deadline_s: float) -> int:
        """The child's exit code once it exits by itself; `ProcessFailed` if it is still
        running after `deadline_s`."""
        try:
            return self.process.wait(deadline_s)
        except subprocess.TimeoutExpired:
            raise ProcessFailed(
                f"{self.name} still running after {deadline_s:g}s; log {self.log_path}:\n"
                f"{self.log_tail()}"
            ) from None

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


def start_process(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    url: str | None = None,
    cwd: Path | None = None,
) -> ManagedProcess:
    """Start `argv` in its own session, stdout and stderr appended to `log_path`, with
    `env` added to this process's environment. Does not wait; see `wait_http`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
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
    log.info("started %s (pid %d): %s", name, process.pid, " ".join(argv))
    return ManagedProcess(name, process, log_path, url)


def stop_all(children: Iterable[ManagedProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every child first, wait up to `grace_s` for all of them together, then
    SIGKILL what is left, in the order given."""
    children = list(children)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.finish(deadline)


@dataclass
class ProcessGroup:
    """Every child one owner started; a context manager that stops them all on exit.

    While open, SIGTERM is turned into `KeyboardInterrupt` so a terminated owner cleans up
    exactly like one interrupted with Ctrl-C.
    """

    log_dir: Path
    children: list[ManagedProcess] = field(default_factory=list)
    # Children the others call on their way out (agents deregister with the control plane).
    serving_others: list[ManagedProcess] = field(default_factory=list)
    _previous_sigterm: object = None

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        url: str | None = None,
        cwd: Path | None = None,
        serves_others: bool = False,
    ) -> ManagedProcess:
        """`start_process` with output to `<log_dir>/<name>.log`, remembered for `stop_all`.

        `serves_others`: the other children call this one while they stop, so it is stopped
        only after they have exited (or their grace period ran out)."""
        child = start_process(name, argv, self.log_dir / f"{name}.log", env=env, url=url, cwd=cwd)
        (self.serving_others if serves_others else self.children).append(child)
        return child

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every child, newest first (agents deregister before their engines go), then
        those serving the others, and forget them: a second call signals nothing (their
        process ids may be reused)."""
        stop_all(reversed(self.children), grace_s)
        self.children.clear()
        stop_all(reversed(self.serving_others), grace_s)
        self.serving_others.clear()

    def __enter__(self) -> ProcessGroup:
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        with contextlib.suppress(ValueError):  # not the main thread: leave SIGTERM alone
            signal.signal(signal.SIGTERM, _interrupt)
        return self

    def __exit__(self, *_exc: object) -> None:
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
    """In the child before exec: ask Linux to SIGTERM it when the thread that started it
    dies. A no-op where prctl does not exist."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
