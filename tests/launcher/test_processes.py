"""`ProcessGroup`: what one owner started is stopped in an order the children can rely on."""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.processes import ProcessGroup, wait_until

# On SIGTERM, take a moment (an agent's deregistration call), then write whether the process
# whose id is argv[1] is still alive, and exit.
CLIENT = """
import os, signal, sys, time
def stop(*_):
    time.sleep(0.3)
    try:  # the state field of /proc/PID/stat; a zombie (Z) has exited
        state = open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "Z"
    open(sys.argv[2], "w").write("gone" if state in "ZX" else "alive")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[3], "w").write("ready")
while True:
    time.sleep(1)
"""


def test_children_serving_the_others_are_stopped_only_after_the_others_exit(
    tmp_path: Path,
) -> None:
    seen = [tmp_path / f"seen-{i}" for i in range(2)]
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    with ProcessGroup(tmp_path / "logs") as group:
        server = group.start(
            "server", [sys.executable, "-c", "import time; time.sleep(600)"], serves_others=True
        )
        for i in range(2):
            group.start(
                f"client-{i}",
                [sys.executable, "-c", CLIENT, str(server.process.pid), str(seen[i]),
                 str(ready[i])],
            )  # fmt: skip
        wait_until(
            lambda: all(path.exists() for path in ready), deadline_s=60.0, what="clients started"
        )
    assert [path.read_text() for path in seen] == ["alive", "alive"]
    assert not server.alive()
    assert group.children == [] and group.serving_others == []
