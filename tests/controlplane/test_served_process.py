"""The served process (`tether controlplane serve`): a request head too large for the cap
is refused by the HTTP parser itself before it is buffered, so a 16 MB header cannot get
around the body limit, and the server goes on serving; SIGTERM ends the process although
long-polls are open (they may last a minute), answering them rather than cancelling them."""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from launcher.processes import ManagedProcess
from tests.controlplane.conftest import ADMIN, start_controlplane


def fresh(tmp_path: Path, processes: list[ManagedProcess]) -> ManagedProcess:
    store = tmp_path / "store"
    store.mkdir()
    cp = start_controlplane(f"sqlite:///{tmp_path / 'cp.db'}", store, tmp_path / "cp.log")
    processes.append(cp)
    return cp


def raw_request(url: str, head: bytes) -> bytes:
    """Send `head` on a fresh connection and read the answer until the server ends it."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        # The server may stop reading once it has answered.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("size", [1 << 20, 16 << 20])
def test_a_huge_header_is_a_431_from_the_server_and_serving_goes_on(
    tmp_path: Path, processes: list[ManagedProcess], size: int
) -> None:
    cp = fresh(tmp_path, processes)
    head = (
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ADMIN.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\nX-Session-ID: "
        + b"s" * size + b"\r\n\r\n{}"
    )  # fmt: skip
    answer = raw_request(cp.url, head)

    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 431"), answer[:200]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["type"] == "HeadersTooLarge"
    ok = httpx.get(cp.url + "/v1/runs", headers={"Authorization": f"Bearer {ADMIN}"})
    assert ok.status_code == 200


def test_sigterm_ends_the_control_plane_while_long_polls_are_open_and_answers_them(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    cp = fresh(tmp_path, processes)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.post(cp.url + "/v1/runs", json={"run_id": "r"}, headers=headers).is_success
    engine = {"url": "http://127.0.0.1:9", "run_id": "r", "precision": "bf16"}
    registered = httpx.post(cp.url + "/v1/engines", json=engine, headers=headers)
    assert registered.status_code == 201, registered.text
    engine_id = registered.json()["engine_id"]
    parts = urlsplit(cp.url)
    polls = []
    waits = ["/v1/runs/r/versions/wait?after=0"] * 3 + [f"/v1/engines/{engine_id}/target?after=0"]
    for path in waits:
        sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        sock.sendall(
            f"GET {path}&timeout=60 HTTP/1.1\r\nHost: x\r\n".encode()
            + b"Authorization: Bearer "
            + ADMIN.encode()
            + b"\r\n\r\n"
        )
        polls.append(sock)
    # One event loop reads requests in arrival order: once a later request is answered,
    # the long-polls sent before it are being served.
    assert httpx.get(cp.url + "/v1/runs/r", headers=headers).status_code == 200

    cp.terminate()
    # Without a bounded graceful shutdown the process waits out the 60 s long-polls.
    assert cp.wait_exit(30) is not None
    nothing_new = [{"versions": []}] * 3 + [{"target_version": 0, "changed": False}]
    for sock, expected in zip(polls, nothing_new, strict=True):
        # Each poll got a clean "nothing new yet" answer, not a reset: its client polls again.
        answer = b"".join(iter(lambda sock=sock: sock.recv(65536), b""))
        sock.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert json.loads(answer.partition(b"\r\n\r\n")[2]) == expected
    log = (tmp_path / "cp.log").read_text()
    assert "Traceback" not in log and "Cancel" not in log, log[-2000:]
