"""Resource limits of one sandboxed command and their translation to `prlimit` flags.

Owns the numbers (memory, file size, processes, open files, CPU seconds, output caps) and
nothing else: it never starts a process. Sizes are bytes, as `prlimit` wants them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Per-command limits; every sandboxed process tree gets all of them.

    `processes` is RLIMIT_NPROC, counted per host uid: it only holds when the command runs
    as a non-root uid of its own, which the local backend arranges when the host user is root.
    `output_cap_bytes` is the most stdout+stderr one command may produce before it is killed;
    `output_keep_bytes` is how much of the head and of the tail of each stream is kept.
    `shm_size_bytes` caps the private /dev/shm (POSIX semaphores, `multiprocessing.Lock`).
    """

    address_space_bytes: int = 4 << 30
    file_size_bytes: int = 64 << 20
    processes: int = 256
    open_files: int = 1024
    tmp_size_bytes: int = 256 << 20
    shm_size_bytes: int = 64 << 20
    output_cap_bytes: int = 16 << 20
    output_keep_bytes: int = 32 << 10

    def prlimit_argv(self, timeout_s: float) -> list[str]:
        """`prlimit` flags for a command allowed `timeout_s` of wall clock.

        CPU seconds get the same budget plus a margin, so a busy loop is killed by the kernel
        even if the wall-clock watchdog were late.
        """
        cpu = math.ceil(timeout_s) + 5
        return [
            "prlimit",
            f"--as={self.address_space_bytes}",
            f"--fsize={self.file_size_bytes}",
            f"--nproc={self.processes}",
            f"--nofile={self.open_files}",
            "--core=0",
            f"--cpu={cpu}",
            "--",
        ]
