"""The local bubblewrap backend isolates, limits and cleans up, for real, on this machine."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from sandboxes.base import SandboxSpec
from sandboxes.errors import IsolationUnavailable
from sandboxes.limits import Limits
from sandboxes.local import LocalSandbox, probe_isolation
from sandboxes.settings import SandboxSettings

PY = sys.executable


def run_py(sandbox: LocalSandbox, code: str, **kwargs):
    return sandbox.exec([PY, "-c", code], **kwargs)


def test_isolation_is_available_on_this_machine():
    report = probe_isolation()
    assert report.level == "bwrap", report.detail


def test_commands_cannot_reach_the_network_not_even_host_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)\n"
            "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
            "    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)\n"
        )
        with LocalSandbox() as sandbox:
            result = run_py(sandbox, code, timeout_s=30)
    assert result.ok, result.describe()
    assert result.stdout.decode().split("\n").count("connected") == 0
    assert result.stdout.decode().count("blocked") == 2


def test_root_is_read_only_and_only_the_sandbox_folders_are_writable():
    with LocalSandbox(SandboxSpec(extra_dirs=("report",))) as sandbox:
        result = sandbox.exec(
            [
                "sh",
                "-c",
                "touch /usr/x /etc/x 2>&1; touch ./w $0/r && echo wrote",
                sandbox.dir("report"),
            ]
        )
    out = result.stdout.decode()
    assert out.count("Read-only file system") == 2
    assert "wrote" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop happens only when the host is root")
def test_commands_run_as_a_leased_unprivileged_uid_when_the_host_is_root():
    with LocalSandbox() as first, LocalSandbox() as second:
        uids = [int(s.exec(["id", "-u"]).stdout) for s in (first, second)]
    assert uids == [first.uid, second.uid]
    assert uids[0] != uids[1] and 0 not in uids


def test_host_environment_and_secrets_do_not_leak_in(monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "hunter2")
    with LocalSandbox() as sandbox:
        result = sandbox.exec(["env"])
    assert b"hunter2" not in result.stdout
    assert b"HOME=/tmp" in result.stdout


def test_files_round_trip_and_trees_upload(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.txt").write_text("alpha")
    with LocalSandbox() as sandbox:
        sandbox.upload_tree(tmp_path)
        sandbox.write_file("deep/b.bin", bytes(range(256)))
        assert sandbox.read_file("pkg/a.txt") == b"alpha"
        assert sandbox.read_file(f"{sandbox.workdir}/deep/b.bin") == bytes(range(256))
        with pytest.raises(FileNotFoundError):
            sandbox.read_file("missing.txt")


def test_sleeping_forever_is_killed_at_the_timeout_with_its_escaped_children():
    with LocalSandbox() as sandbox:
        result = sandbox.exec(
            ["sh", "-c", "setsid sleep 600 & nohup sleep 601 & sleep 602"], timeout_s=1
        )
    assert result.timed_out and not result.ok
    assert result.duration_s < 10


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind():
    spec = SandboxSpec(limits=Limits(processes=32))
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    with LocalSandbox(spec) as sandbox:
        result = run_py(sandbox, bomb, timeout_s=3)
        after = sandbox.exec(["echo", "alive"], timeout_s=10)
    assert result.timed_out
    assert after.stdout == b"alive\n"


def test_gigabytes_of_output_are_cut_off_at_the_cap():
    spec = SandboxSpec(limits=Limits(output_cap_bytes=1 << 20, output_keep_bytes=4096))
    code = (
        "import sys\nchunk = b'x' * (1 << 20)\n"
        "for _ in range(4096):\n    sys.stdout.buffer.write(chunk)\n"
    )
    with LocalSandbox(spec) as sandbox:
        result = run_py(sandbox, code, timeout_s=60)
    assert result.output_limited and result.stdout_truncated
    assert len(result.stdout) < 16384
    assert result.duration_s < 30


def test_memory_is_capped_by_the_address_space_limit():
    spec = SandboxSpec(limits=Limits(address_space_bytes=512 << 20))
    with LocalSandbox(spec) as sandbox:
        result = run_py(sandbox, "x = bytearray(1 << 30)", timeout_s=30)
    assert result.exit_code != 0
    assert b"MemoryError" in result.stderr


def test_hidden_paths_are_masked_inside_the_sandbox(tmp_path: Path):
    secret = Path("/var/tmp") / f"tether-hidden-{os.getpid()}"
    secret.mkdir(exist_ok=True)
    (secret / "answer.txt").write_text("42")
    try:
        with LocalSandbox(SandboxSpec(hidden_paths=(str(secret),))) as sandbox:
            result = sandbox.exec(["ls", "-A", str(secret)])
    finally:
        (secret / "answer.txt").unlink()
        secret.rmdir()
    assert result.ok and result.stdout == b""


def test_refuses_to_run_unisolated_unless_told_to(tmp_path: Path):
    settings = SandboxSettings(bwrap=str(tmp_path / "no-bwrap-here"))
    with pytest.raises(IsolationUnavailable, match="allow_unisolated"):
        LocalSandbox(settings=settings)
    with LocalSandbox(settings=settings, allow_unisolated=True) as sandbox:
        result = sandbox.exec(["sh", "-c", "pwd"])
    assert sandbox.isolation == "none"
    assert result.stdout.decode().strip() == sandbox.workdir


def test_parallel_sandboxes_do_not_share_a_uid_or_folder():
    results = {}

    def work(name: str) -> None:
        with LocalSandbox() as sandbox:
            sandbox.write_file("mine.txt", name.encode())
            results[name] = (sandbox.read_file("mine.txt"), sandbox.exec(["id", "-u"]).stdout)

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {k: v[0] for k, v in results.items()} == {"a": b"a", "b": b"b", "c": b"c"}
    if os.geteuid() == 0:
        assert len({v[1] for v in results.values()}) == 3


def test_dev_shm_is_private_writable_and_size_capped(tmp_path: Path):
    """multiprocessing.Lock is a POSIX semaphore in /dev/shm; a read-only one breaks it."""
    limits = Limits(shm_size_bytes=4 << 20)
    code = (
        "import multiprocessing, os\n"
        "lock = multiprocessing.Lock()\n"
        "with lock:\n    print('locked')\n"
        "print('host file seen', os.path.exists('/dev/shm/tether-host-marker'))\n"
        "try:\n"
        "    with open('/dev/shm/big', 'wb') as f:\n"
        "        f.write(b'x' * (8 << 20))\n"
        "    print('wrote past the cap')\n"
        "except OSError as e:\n    print('capped', e.errno)\n"
    )
    marker = Path("/dev/shm/tether-host-marker")
    try:
        marker.write_text("host")
        with LocalSandbox(SandboxSpec(limits=limits)) as sandbox:
            result = run_py(sandbox, code)
    finally:
        marker.unlink(missing_ok=True)
    out = result.stdout.decode()
    assert result.ok, result.describe()
    assert "locked" in out and "host file seen False" in out and "capped" in out, out
