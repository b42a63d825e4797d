"""A PostgreSQL server from the machine's binaries, for the tests and the chaos benchmark.

`PostgresServer.create()` runs `initdb` into a fresh folder under /tmp and picks a loopback
port; `start()` starts it with `pg_ctl` and waits (with a deadline) until it accepts
connections; `stop()` stops it at once (`-m immediate`, as a crash would), and a later
`start()` brings the same data back on the same port; `remove()` stops it and deletes the
folder. PostgreSQL refuses to run as root, so under root the server runs as the `postgres`
(or `nobody`) user. It never creates tables: that is the control plane's migrations' job.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from launcher.processes import ProcessFailed, free_port, wait_until

START_DEADLINE_S = 60.0


def find_pg_bin() -> Path | None:
    """The folder holding `initdb` and `pg_ctl`, or None when PostgreSQL is not installed."""
    candidates = [os.path.dirname(p) for p in filter(None, [shutil.which("initdb")])]
    candidates += ["/usr/local/bin", *sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for folder in candidates:
        if (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    return None


def _unprivileged_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("running as root and no 'postgres' or 'nobody' user to run PostgreSQL")


@dataclass
class PostgresServer:
    """One PostgreSQL data folder and the loopback port it serves on."""

    bin_dir: Path
    root: Path
    port: int
    user: str | None

    @classmethod
    def create(cls, bin_dir: Path | None = None) -> PostgresServer:
        """`initdb` a new cluster (trust auth, superuser `postgres`); not started yet."""
        found = bin_dir or find_pg_bin()
        if found is None:
            raise FileNotFoundError("PostgreSQL binaries (initdb, pg_ctl) are not installed")
        user = _unprivileged_user()
        # Its own folder under /tmp (a pytest tmp folder is 0700 and root-owned under root).
        root = Path(tempfile.mkdtemp(prefix="tether-pg-"))
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        server = cls(found, root, free_port(), user)
        server._run(
            "initdb", "-D", str(server.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"
        )
        return server

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    @property
    def pid(self) -> int:
        """The running server's process id (its postmaster, parent of every backend)."""
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of `database` on this server."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> PostgresServer:
        """Start the server and return once it accepts connections."""
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=300"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-o", options, "start")
        try:
            wait_until(self._accepts, START_DEADLINE_S, f"PostgreSQL on port {self.port}", 0.1)
        except TimeoutError:
            raise ProcessFailed(
                f"PostgreSQL did not accept connections in {START_DEADLINE_S:g}s:\n"
                + self.log_path.read_text(errors="replace")[-3000:]
            ) from None
        return self

    def stop(self) -> None:
        """Stop at once, as a crash would (no checkpoint; the next start replays the WAL)."""
        subprocess.run(
            self._argv("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop"),
            capture_output=True,
        )

    def remove(self) -> None:
        """Stop the server and delete its folder."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def create_database(self, name: str) -> str:
        """(Re)create database `name`; return its SQLAlchemy URL."""
        import psycopg

        plain = self.url().replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def _accepts(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(
                host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                connect_timeout=2,
            ):  # fmt: skip
                return True
        except psycopg.OperationalError:
            return False

    def _argv(self, program: str, *args: str) -> list[str]:
        argv = [str(self.bin_dir / program), *args]
        return argv if self.user is None else ["runuser", "-u", self.user, "--", *argv]

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(self._argv(program, *args), check=True, capture_output=True)
