"""Leases of host uids for sandboxed commands, one uid per live sandbox, across processes.

A lease is an exclusive `flock` on `<lease_dir>/<uid>.lock`, so two scorers on one machine
never share a uid and the kernel releases the lease if a scorer dies. Owns also the sweep
that kills every process of a leased uid. It must never touch a uid it has not leased.
"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

from sandboxes.errors import SandboxFailure


class UidLease:
    """An exclusively held host uid (and gid of the same number) for one sandbox."""

    def __init__(self, uid: int, handle: int) -> None:
        self.uid = uid
        self._handle = handle

    @classmethod
    def acquire(cls, lease_dir: Path, first: int, count: int) -> UidLease:
        lease_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for uid in range(first, first + count):
            handle = os.open(lease_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(handle)
                continue
            lease = cls(uid, handle)
            lease.kill_processes()  # leftovers of a scorer that died holding this uid
            return lease
        raise SandboxFailure(
            f"all {count} sandbox uids from {first} are leased; close sandboxes or raise "
            "TETHER_SANDBOX_UID_COUNT"
        )

    def kill_processes(self) -> int:
        """SIGKILL every process whose real uid is the leased one; return how many."""
        killed = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("Uid:"):
                    if int(line.split()[1]) == self.uid:
                        try:
                            os.kill(int(entry), signal.SIGKILL)
                            killed += 1
                        except ProcessLookupError:
                            pass
                    break
        return killed

    def release(self) -> None:
        if self._handle >= 0:
            self.kill_processes()
            os.close(self._handle)
            self._handle = -1
