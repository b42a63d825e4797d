"""`ProcessGroup`: what one owner started is stopped in an order the children can rely on."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

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


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """A port the kernel gives an outgoing connection as its source port is never handed
    out for a server to bind later: every port is below the kernel's ephemeral range, free
    when handed out, and never handed out twice by one process."""
    from launcher.processes import _ephemeral_range, free_port, free_ports

    low, high = _ephemeral_range()
    assert 0 < low <= high
    ports = free_ports(50) + [free_port() for _ in range(10)]
    assert len(set(ports)) == 60
    assert all(10000 <= port < low for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it was not free
    # An outgoing connection's source port (what a bind to port 0 also gets) is in the range.
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", ports[0]))
        server.listen()
        client.connect(("127.0.0.1", ports[0]))
        assert low <= client.getsockname()[1] <= high


# A process with a second thread and a child process; once pinned, it starts another thread
# and reports where that one may run.
PINNED = """
import os, subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
open(sys.argv[1], "w").write(str(child.pid))
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
later = []
thread = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
thread.start(); thread.join()
open(sys.argv[3], "w").write(",".join(map(str, sorted(later[0]))))
child.kill()
"""


def _affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_pin_keeps_every_thread_and_child_of_a_process_and_what_they_start_later_on_its_cpus(
    tmp_path: Path,
) -> None:
    from launcher.processes import pin

    everything = os.sched_getaffinity(0)
    one = {min(everything)}
    started, go, later = tmp_path / "child", tmp_path / "go", tmp_path / "later"
    with ProcessGroup(tmp_path / "logs") as group:
        parent = group.start(
            "pinned", [sys.executable, "-c", PINNED, str(started), str(go), str(later)]
        )
        wait_until(started.exists, deadline_s=60.0, what="the child process started")
        child = int(started.read_text())
        wait_until(lambda: len(_affinities(parent.process.pid)) >= 2, 60.0, "its thread")
        assert pin(parent.process.pid, one) >= 3  # two threads and the child's one
        assert all(cpus == one for cpus in _affinities(parent.process.pid))
        assert _affinities(child) == [one]
        go.write_text("")
        wait_until(later.exists, deadline_s=60.0, what="a thread started after the pin")
        assert {int(cpu) for cpu in later.read_text().split(",")} == one
    assert os.sched_getaffinity(0) == everything  # the caller is not pinned


def test_parse_cpus_reads_lists_and_ranges_and_names_what_it_cannot_use() -> None:
    from launcher.processes import parse_cpus

    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    assert parse_cpus(str(first)) == {first}
    assert parse_cpus(f"{first}-{first}") == {first}
    assert parse_cpus(",".join(map(str, sorted(allowed)))) == allowed
    with pytest.raises(ValueError, match="'x' in CPU list"):
        parse_cpus("x")
    with pytest.raises(ValueError, match="may not run on"):
        parse_cpus(str(max(allowed) + 1000))
