"""The served process answers the hot lane (generate routes, heartbeats, the target
long-poll) with its own exchange instead of an ASGI cycle. A client sees exactly what the
ASGI entry answers (`TETHER_HOT_EXCHANGE=0`): the same status and body for a routed
request, a target, and every refusal (auth, bad JSON or query, limits, 409, unknown
engine), and HTTP/1.1 as uvicorn speaks it:
keep-alive, pipelined requests answered in order, `Connection: close` honoured. Both
processes share one database, so they see the same fleet, and run side by side."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from launcher.processes import ManagedProcess, wait_until
from tests.controlplane.conftest import ADMIN, publish, start_controlplane, start_standin

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
BODY_LIMIT = 4096
NEGATIVE_VERSION = b'{"weight_version": {"min_version": -1}}'
BAD_HEARTBEAT = b'{"applied_version": "x"}'
ROUTED_200 = re.compile(r'^tether_requests_total\{route="/v1/generate",status="200"\} (\S+)$', re.M)
ENV = {"TETHER_SNAPSHOT_REFRESH_S": "0.2", "TETHER_MAX_BODY_BYTES": str(BODY_LIMIT)}


class Served:
    """One control-plane process and the tokens the requests below use."""

    def __init__(self, process: ManagedProcess, tokens: dict[str, str]) -> None:
        assert process.url is not None
        self.process = process
        parts = urlsplit(process.url)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.tokens = tokens

    def exchange(self, raw: bytes, answers: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
        """Send `raw` (one or more requests) on a fresh connection; read `answers` answers."""
        with socket.create_connection(self.address, timeout=30) as sock:
            sock.sendall(raw)
            return read_answers(sock, answers)


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` HTTP/1.1 answers (Content-Length or chunked) read from `sock`."""
    buffer = b""
    out = []

    def fill(until: bytes | int) -> None:
        nonlocal buffer
        while (until not in buffer) if isinstance(until, bytes) else (len(buffer) < until):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed early; have {buffer[:300]!r}"
            buffer += chunk

    for _ in range(count):
        fill(b"\r\n\r\n")
        head, buffer = buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if "content-length" in headers:
            fill(int(headers["content-length"]))
            length = int(headers["content-length"])
            body, buffer = buffer[:length], buffer[length:]
        else:
            assert headers.get("transfer-encoding") == "chunked", headers
            parts = []
            while True:
                fill(b"\r\n")
                size_line, buffer = buffer.split(b"\r\n", 1)
                size = int(size_line, 16)
                fill(size + 2)
                parts.append(buffer[:size])
                buffer = buffer[size + 2 :]
                if size == 0:
                    break
            body = b"".join(parts)
        out.append((status, headers, body))
    return out


def post(path: str, body: bytes, token: str | None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def get(path: str, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{auth}\r\n".encode()


def generate(version: dict[str, int] | None = None) -> bytes:
    return json.dumps({"text": "hi", "weight_version": version or {"min_version": 1}}).encode()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """(own exchange, ASGI entry): two processes on one database, one stand-in engine."""
    root = tmp_path_factory.mktemp("hot-exchange")
    store = root / "store"
    store.mkdir()
    db = f"sqlite:///{root / 'cp.db'}"
    started: list[ManagedProcess] = []
    try:
        fast = start_controlplane(db, store, root / "fast.log", **ENV)
        started.append(fast)
        plain = start_controlplane(db, store, root / "asgi.log", TETHER_HOT_EXCHANGE="0", **ENV)
        started.append(plain)
        assert fast.url is not None and plain.url is not None
        created = httpx.post(fast.url + "/v1/runs", json={"run_id": "x"}, headers=ADMIN_HEADERS)
        assert created.status_code == 201, created.text
        publish(store, "x", 1)
        notified = httpx.post(
            fast.url + "/v1/runs/x/versions", json={"version": 1}, headers=ADMIN_HEADERS
        )
        assert notified.status_code == 201, notified.text
        tokens = {
            role: httpx.post(
                fast.url + "/v1/tokens", json={"role": role}, headers=ADMIN_HEADERS
            ).json()["token"]
            for role in ("client", "engine")
        }
        engine = start_standin(1, root / "engine.log", "--controlplane", fast.url,
                               "--token", tokens["engine"], "--run-id", "x")  # fmt: skip
        started.append(engine)
        for url in (fast.url, plain.url):
            wait_until(
                lambda url=url: httpx.get(url + "/v1/route", headers=ADMIN_HEADERS).is_success,
                30,
                f"the stand-in to be routable at {url}",
            )
        tokens["engine_id"] = httpx.get(fast.url + "/v1/route", headers=ADMIN_HEADERS).json()[
            "engine_id"
        ]
        yield Served(fast, tokens), Served(plain, tokens)
    finally:
        for process in reversed(started):
            process.stop()


def requests_of_every_kind(tokens: dict[str, str]) -> dict[str, bytes]:
    client, engine = tokens["client"], tokens["engine"]
    heartbeat = json.dumps({"applied_version": 1, "sync_state": "ready"}).encode()
    beat = f"/v1/engines/{tokens['engine_id']}/heartbeat"
    target = f"/v1/engines/{tokens['engine_id']}/target"
    return {
        "routed": post("/v1/generate", generate(), client),
        "heartbeat of the stand-in": post(beat, heartbeat, engine),
        "no token": post("/v1/generate", generate(), None),
        "unknown token": post("/v1/generate", generate(), "tth_nobody"),
        "wrong role": post("/v1/generate", generate(), engine),
        "not JSON": post("/v1/generate", b"{not json", client),
        "bad weight_version": post("/v1/generate", NEGATIVE_VERSION, client),
        "version not served yet": post("/v1/generate", generate({"exact_version": 2}), client),
        "declared body too large": post("/v1/generate", b" " * (BODY_LIMIT + 1), client),
        "chunked body too large": (
            f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {client}\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n{BODY_LIMIT + 10:x}\r\n"
        ).encode()
        + b" " * (BODY_LIMIT + 10)
        + b"\r\n0\r\n\r\n",
        "unknown engine heartbeat": post("/v1/engines/nope/heartbeat", heartbeat, engine),
        "heartbeat with a client token": post("/v1/engines/nope/heartbeat", heartbeat, client),
        "heartbeat body invalid": post("/v1/engines/nope/heartbeat", BAD_HEARTBEAT, engine),
        "target changed": get(f"{target}?after=0&timeout=5", engine),
        "target with no after": get(f"{target}?timeout=5", engine),
        "target after repeated": get(f"{target}?after=1&after=0&timeout=5", engine),
        "target bad after": get(f"{target}?after=-1", engine),
        "target bad timeout": get(f"{target}?after=0&timeout=soon", engine),
        "target of an unknown engine": get("/v1/engines/nope/target?after=0", engine),
        "target with a client token": get(f"{target}?after=0", client),
        "target with no token": get(f"{target}?after=0", None),
    }


def comparable(answer: tuple[int, dict[str, str], bytes]) -> tuple[int, object]:
    """Status and JSON body, less the lease end (it is the time of each answer)."""
    status, _headers, body = answer
    found = json.loads(body) if body else None
    if isinstance(found, dict):
        found.pop("lease_expires_at", None)
    return status, found


def test_every_hot_answer_is_the_one_the_asgi_entry_gives(pair: tuple[Served, Served]) -> None:
    fast, plain = pair
    for name, raw in requests_of_every_kind(fast.tokens).items():
        ours = fast.exchange(raw)[0]
        theirs = plain.exchange(raw)[0]
        assert comparable(ours) == comparable(theirs), name
        if name.startswith("heartbeat of"):
            assert ours[0] == 200 and json.loads(ours[2])["target_version"] == 1
        elif name.startswith("target changed") or name.startswith("target with no after"):
            assert ours == (200, ours[1], b'{"target_version":1,"changed":true}'), name
        elif name == "target after repeated":
            assert comparable(ours) == (200, {"target_version": 1, "changed": True})
        elif name == "routed":
            status, headers, body = ours
            assert status == 200
            assert json.loads(body)["engine_id"] == headers["x-tether-engine-id"]
            assert headers["x-tether-weight-version-start"] == "1"
        else:
            assert ours[0] >= 400, name


def test_requests_pipelined_on_one_connection_are_answered_in_order(
    pair: tuple[Served, Served],
) -> None:
    fast, _ = pair
    client = fast.tokens["client"]
    raw = (
        post("/v1/generate", generate(), client)
        + b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
        + post("/v1/generate", generate({"exact_version": 2}), client)
        + get(f"/v1/engines/{fast.tokens['engine_id']}/target?after=0", fast.tokens["engine"])
        + post("/v1/chat/completions", generate(), client)
    )
    answers = fast.exchange(raw, 5)
    assert [a[0] for a in answers] == [200, 200, 409, 200, 200]
    assert json.loads(answers[1][2])["status"] == "ok"
    assert json.loads(answers[2][2])["error"]["type"] == "WeightVersionNotReady"
    assert json.loads(answers[3][2]) == {"target_version": 1, "changed": True}


def test_a_request_left_to_asgi_after_a_hot_one_keeps_its_headers_and_path(
    pair: tuple[Served, Served],
) -> None:
    # The exchange builds uvicorn's ASGI scope only for a request it leaves to ASGI: the
    # headers and URL parsed before that must all be in it (the token decides the answer).
    fast, _ = pair
    raw = (
        post("/v1/generate", generate(), fast.tokens["client"])
        + b"GET /v1/engines?run_id=r HTTP/1.1\r\nHost: t\r\n"
        + f"Authorization: Bearer {ADMIN}\r\n\r\n".encode()
        + b"GET /v1/engines HTTP/1.1\r\nHost: t\r\n\r\n"
    )
    answers = fast.exchange(raw, 3)
    assert [a[0] for a in answers] == [200, 200, 401]
    assert "engines" in json.loads(answers[1][2])
    assert json.loads(answers[2][2])["error"]["type"] == "Unauthorized"


def test_connection_close_is_honoured_and_keep_alive_is_the_default(
    pair: tuple[Served, Served],
) -> None:
    fast, _ = pair
    client = fast.tokens["client"]
    with socket.create_connection(fast.address, timeout=30) as sock:
        for _ in range(3):  # one connection, several requests
            sock.sendall(post("/v1/generate", generate(), client))
            (status, headers, _body), = read_answers(sock, 1)  # fmt: skip
            assert status == 200 and headers.get("connection") != "close"
        sock.sendall(post("/v1/generate", generate(), client, "Connection: close\r\n"))
        (status, headers, _body), = read_answers(sock, 1)  # fmt: skip
        assert status == 200 and headers["connection"] == "close"
        assert sock.recv(1) == b""  # the server ended the connection


def test_the_exchange_counts_its_requests_in_the_metrics(pair: tuple[Served, Served]) -> None:
    fast, _ = pair

    def routed() -> float:
        found = ROUTED_200.search(httpx.get(f"{fast.process.url}/metrics", timeout=10).text)
        return float(found.group(1)) if found else 0.0

    before = routed()
    fast.exchange(post("/v1/generate", generate(), fast.tokens["client"]))
    assert routed() == before + 1


def test_a_client_gone_before_its_body_ended_is_counted_as_499_on_both_entries(
    pair: tuple[Served, Served],
) -> None:
    gone = re.compile(r'^tether_requests_total\{route="/v1/generate",status="499"\} (\S+)$', re.M)
    head_only = post("/v1/generate", generate(), pair[0].tokens["client"])[:-5]
    for served in pair:

        def counted(served: Served = served) -> float:
            found = gone.search(httpx.get(f"{served.process.url}/metrics", timeout=10).text)
            return float(found.group(1)) if found else 0.0

        before = counted()
        with socket.create_connection(served.address, timeout=30) as sock:
            sock.sendall(head_only)  # the last bytes of the body never come
        wait_until(
            lambda before=before: counted() == before + 1, 30, "the abandoned request counted"
        )


def test_routed_requests_in_a_row_on_one_connection_each_reach_the_engine(
    pair: tuple[Served, Served],
) -> None:
    """The exchange answers a routed request from the engine connection's callbacks:
    back-to-back requests reuse both connections and each gets its own engine answer."""
    fast, _ = pair
    raw = post("/v1/generate", generate(), fast.tokens["client"])
    with socket.create_connection(fast.address, timeout=30) as sock:
        for _ in range(20):
            sock.sendall(raw)
            [(status, headers, body)] = read_answers(sock, 1)
            assert status == 200, body
            assert json.loads(body)["engine_id"] == headers["x-tether-engine-id"]
