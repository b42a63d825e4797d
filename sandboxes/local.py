"""The local backend: commands isolated by bubblewrap, as a leased non-root uid, under rlimits.

Each `exec` is one fresh `bwrap` invocation: the host root bound read-only, a private
size-capped /tmp and /dev/shm, the sandbox's own folders as the only writable binds, new
network, PID, IPC and UTS namespaces, a new session, a cleared environment, killed when its
parent dies.
When the host user is root the sandbox leases a uid of its own (`sandboxes.uids`) and drops
to it with `setpriv` inside bwrap, because RLIMIT_NPROC does not hold for root; folders of
root that are not world-traversable (e.g. a pyenv under /root) are masked with a tmpfs and
only the interpreter's prefix is bound back, read-only. Wall clock and output size are
enforced from here by killing bwrap, whose death takes the whole PID namespace with it.

This module must never run a command without isolation unless the caller allowed it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sandboxes.base import ExecResult, Sandbox, SandboxSpec
from sandboxes.errors import IsolationUnavailable, SandboxFailure
from sandboxes.output import CappedStream, drain_in_thread
from sandboxes.settings import SandboxSettings
from sandboxes.uids import UidLease

log = logging.getLogger(__name__)

FULL = "bwrap"
NO_PID = "bwrap-no-pid"
NONE = "none"
PROBE_UID = 65534
SANDBOX_TMP = "/tmp"


@dataclass(frozen=True)
class IsolationReport:
    """What the local backend can do on this machine, and why not more."""

    level: str
    detail: str
    bwrap: str | None
    drops_to_uid: bool


def base_env(python: str) -> dict[str, str]:
    """The whole environment of a sandboxed command before the caller's additions."""
    return {
        "PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": SANDBOX_TMP,
        "TMPDIR": SANDBOX_TMP,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }


def _blocked_prefixes(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(untraversable ancestor, path to bind back) for paths other uids cannot reach."""
    plan: list[tuple[str, str]] = []
    for path in paths:
        parts = Path(path).parts
        for depth in range(2, len(parts)):
            ancestor = str(Path(*parts[:depth]))
            try:
                mode = os.stat(ancestor).st_mode
            except OSError:
                break
            if not mode & stat.S_IXOTH:
                # Bind the ancestor's child on the way: bwrap would create deeper mount
                # points inside the masking tmpfs with modes other uids cannot traverse.
                plan.append((ancestor, str(Path(*parts[: depth + 1]))))
                break
    return plan


def interpreter_roots(python: str) -> list[str]:
    """Folders an interpreter needs to start: its own prefix and the one it links to."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    real = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    return sorted({venv, real})


def bwrap_argv(
    *,
    bwrap: str,
    level: str,
    uid: int | None,
    binds: Sequence[tuple[str, str]],
    hidden: Sequence[str],
    python: str,
    network: bool,
    tmp_size: int,
    chdir: str,
    shm_size: int = 64 << 20,
    env: Mapping[str, str],
) -> list[str]:
    """The bwrap (and, as root, setpriv) prefix that isolates one command."""
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev"]
    if level == FULL:
        argv += ["--proc", "/proc"]
    # `--dev` gives a read-only /dev/shm; a private writable one, capped, so that
    # `multiprocessing.Lock()` (a POSIX semaphore there) works as it does outside.
    argv += ["--perms", "1777", "--size", str(shm_size), "--tmpfs", "/dev/shm"]
    argv += ["--size", str(tmp_size), "--tmpfs", SANDBOX_TMP]
    # The private /tmp would hide an interpreter that lives under it (a venv in a checkout
    # under /tmp, as CI clones have): bind back, read-only, its top folder under /tmp, as
    # the host root is bound. Not the prefix itself: bwrap would create the folders on the
    # way with modes the sandbox uid cannot traverse.
    for root in interpreter_roots(python):
        if root != SANDBOX_TMP and os.path.commonpath([root, SANDBOX_TMP]) == SANDBOX_TMP:
            top = os.path.join(SANDBOX_TMP, os.path.relpath(root, SANDBOX_TMP).split(os.sep)[0])
            argv += ["--ro-bind", top, top]
    if uid is not None:
        masked: set[str] = set()
        for ancestor, keep in _blocked_prefixes(interpreter_roots(python)):
            if ancestor not in masked:
                argv += ["--tmpfs", ancestor]
                masked.add(ancestor)
            argv += ["--ro-bind", keep, keep]
    for path in hidden:
        if os.path.isdir(path):
            argv += ["--tmpfs", path]
        elif os.path.exists(path):
            argv += ["--ro-bind", "/dev/null", path]
    for host, inside in binds:
        argv += ["--bind", host, inside]
    argv += ["--chdir", chdir, "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        argv.append("--unshare-net")
    if level == FULL:
        argv.append("--unshare-pid")
    if uid is None:
        argv.append("--unshare-user")
    argv += ["--die-with-parent", "--new-session", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if uid is not None:
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
            argv += ["--cap-add", cap]
        argv += ["--", *setpriv_argv(uid)]
    else:
        argv.append("--")
    return argv


def setpriv_argv(uid: int) -> list[str]:
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


@lru_cache(maxsize=4)
def probe_isolation(bwrap: str = "bwrap") -> IsolationReport:
    """Find the strongest isolation that works here by running `true` under each level."""
    path = shutil.which(bwrap)
    root = os.geteuid() == 0
    if path is None:
        return IsolationReport(
            NONE,
            f"bubblewrap ({bwrap}) is not installed; install it with "
            "`apt-get install -y bubblewrap`",
            None,
            root,
        )
    if root and shutil.which("setpriv") is None:
        return IsolationReport(
            NONE, "setpriv (util-linux) is missing; it is needed to drop root", path, root
        )
    failures = []
    for level in (FULL, NO_PID):
        argv = bwrap_argv(
            bwrap=path,
            level=level,
            uid=PROBE_UID if root else None,
            binds=[],
            hidden=[],
            python="/usr/bin/true",
            network=False,
            tmp_size=1 << 20,
            chdir="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        done = subprocess.run(
            [*argv, "true"], capture_output=True, timeout=30, stdin=subprocess.DEVNULL
        )
        if done.returncode == 0:
            detail = "all namespaces, read-only root" if level == FULL else "no PID namespace"
            if root:
                detail += "; commands drop from root to a leased uid via setpriv"
            return IsolationReport(level, detail, path, root)
        failures.append(f"{level}: {done.stderr.decode(errors='replace').strip()}")
    return IsolationReport(
        NONE,
        "bubblewrap cannot create namespaces here ("
        + "; ".join(failures)
        + "); on Ubuntu set kernel.apparmor_restrict_unprivileged_userns=0, in Docker run "
        "with --security-opt seccomp=unconfined",
        path,
        root,
    )


class LocalSandbox(Sandbox):
    """A sandbox on this machine; see the module docstring for the isolation it gives."""

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        *,
        allow_unisolated: bool | None = None,
        settings: SandboxSettings | None = None,
    ) -> None:
        self.spec = spec or SandboxSpec()
        self.settings = settings or SandboxSettings()
        allow = self.settings.allow_unisolated if allow_unisolated is None else allow_unisolated
        report = probe_isolation(self.settings.bwrap)
        if report.level == NONE and not allow:
            raise IsolationUnavailable(
                f"local sandbox isolation is unavailable: {report.detail}. Refusing to run "
                "untrusted code unisolated; pass allow_unisolated=True (CLI: --unisolated) "
                "only for trusted code"
            )
        if report.level == NONE:
            log.warning("running sandbox commands WITHOUT isolation: %s", report.detail)
        self.isolation = report.level
        self._report = report
        self._closed = False
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._lease = (
            UidLease.acquire(
                self.settings.lease_dir, self.settings.uid_first, self.settings.uid_count
            )
            if os.geteuid() == 0
            else None
        )
        names = ["work", *self.spec.extra_dirs]
        try:
            scratch = self.settings.scratch_dir
            if scratch is not None:
                scratch.mkdir(parents=True, exist_ok=True)
            self._root = Path(tempfile.mkdtemp(prefix="tether-sandbox-", dir=scratch))
            self._host_dirs = {name: self._root / name for name in names}
            for host in self._host_dirs.values():
                host.mkdir(mode=0o700)
                if self._lease is not None:
                    os.chown(host, self._lease.uid, self._lease.uid)
        except OSError as error:
            if self._lease is not None:
                self._lease.release()
            raise SandboxFailure(f"could not create the sandbox's folders: {error}") from error
        if self.isolation == NONE:
            self._inside = {name: str(host) for name, host in self._host_dirs.items()}
        else:
            self._inside = {name: f"{SANDBOX_TMP}/{name}" for name in names}
        self.workdir = self._inside["work"]

    @property
    def uid(self) -> int | None:
        """The host uid commands run as, when this process is root."""
        return self._lease.uid if self._lease else None

    def dir(self, name: str) -> str:
        try:
            return self._inside[name]
        except KeyError:
            raise KeyError(
                f"no folder {name!r} in this sandbox; declare it in SandboxSpec.extra_dirs "
                f"(have {sorted(self._inside)})"
            ) from None

    def _command(
        self, argv: Sequence[str], env: Mapping[str, str], chdir: str, timeout_s: float
    ) -> list[str]:
        limits = self.spec.limits.prlimit_argv(timeout_s)
        if self.isolation == NONE:
            drop = setpriv_argv(self._lease.uid) if self._lease else []
            return [*drop, *limits, *argv]
        prefix = bwrap_argv(
            bwrap=self._report.bwrap or "bwrap",
            level=self.isolation,
            uid=self.uid,
            binds=[(str(self._host_dirs[n]), self._inside[n]) for n in self._host_dirs],
            hidden=self.spec.hidden_paths,
            python=self.spec.python,
            network=self.spec.network,
            tmp_size=self.spec.limits.tmp_size_bytes,
            shm_size=self.spec.limits.shm_size_bytes,
            chdir=chdir,
            env=env,
        )
        return [*prefix, *limits, *argv]

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
        if self._closed:
            raise SandboxFailure("this sandbox is closed; create a new one")
        timeout = timeout_s if timeout_s is not None else self.spec.timeout_s
        cap = output_cap_bytes or self.spec.limits.output_cap_bytes
        keep = output_cap_bytes or self.spec.limits.output_keep_bytes
        full_env = {**base_env(self.spec.python), **(env or {})}
        chdir = self.resolve(workdir) if workdir else self.workdir
        command = self._command(argv, full_env, chdir, timeout)
        status_read, status_write = os.pipe()
        if self.isolation != NONE:
            command[1:1] = ["--json-status-fd", str(status_write)]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_write,),
                env=full_env if self.isolation == NONE else {"PATH": "/usr/bin:/bin"},
                cwd=chdir if self.isolation == NONE else None,
            )
        except OSError as error:
            os.close(status_read)
            os.close(status_write)
            raise SandboxFailure(f"could not start {command[0]}: {error}") from error
        os.close(status_write)
        with self._lock:
            self._procs.add(proc)
        try:
            result = self._supervise(proc, stdin, timeout, cap, keep, started)
        finally:
            with self._lock:
                self._procs.discard(proc)
            with os.fdopen(status_read, "rb") as status_pipe:
                status = status_pipe.read()
        if self.isolation != NONE and b"child-pid" not in status:
            raise SandboxFailure(f"bubblewrap failed to start the command: {result.describe()}")
        return result

    def _supervise(
        self,
        proc: subprocess.Popen[bytes],
        stdin: bytes | None,
        timeout: float,
        cap: int,
        keep: int,
        started: float,
    ) -> ExecResult:
        out, err = CappedStream(keep), CappedStream(keep)
        progressed = threading.Event()
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            drain_in_thread(proc.stdout, out, progressed),
            drain_in_thread(proc.stderr, err, progressed),
        ]
        if stdin is not None:
            threading.Thread(target=_feed, args=(proc, stdin), daemon=True).start()
        deadline = started + timeout
        timed_out = limited = False
        while proc.poll() is None:
            if out.total + err.total > cap:
                limited = True
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if not any(reader.is_alive() for reader in readers):
                # Both pipes are closed, so the command is exiting (bwrap holds them too):
                # wait on the process itself, not on the next 0.1 s tick.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(min(remaining, 0.1))
                continue
            progressed.wait(min(remaining, 0.1))
            progressed.clear()
        if timed_out or limited:
            self._kill(proc)
        proc.wait()
        if self._lease is not None and (timed_out or limited or self.isolation != FULL):
            self._lease.kill_processes()
        for reader in readers:
            reader.join(timeout=10)
        code = proc.returncode
        return ExecResult(
            exit_code=128 - code if code < 0 else code,
            stdout=out.value(),
            stderr=err.value(),
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            timed_out=timed_out,
            output_limited=limited,
            duration_s=time.monotonic() - started,
        )

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        # Killing bwrap tears down its PID namespace; the group kill covers the unisolated mode.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self._lease is not None:
            self._lease.kill_processes()

    def terminate(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            self._kill(proc)
            proc.wait()
        if self._lease is not None:
            self._lease.release()
        shutil.rmtree(self._root, ignore_errors=True)


def _feed(proc: subprocess.Popen[bytes], data: bytes) -> None:
    assert proc.stdin is not None
    try:
        with proc.stdin:
            proc.stdin.write(data)
    except (BrokenPipeError, OSError):
        pass  # the command stopped reading; its exit status tells the story
