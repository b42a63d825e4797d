"""`VersionNotifier` from two threads: each version is announced once, in order."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from store.types import VersionKind
from trainer_client.notifier import PendingVersion, VersionNotifier


@pytest.fixture
def slow_control_plane() -> Iterator[tuple[str, list[int]]]:
    """A loopback server that takes a while to accept each notification, and records it."""
    received: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body["version"])
            # Hold the answer so that a second flush, unguarded, would post the same
            # version before this one is popped from the queue.
            threading.Event().wait(0.3)
            self.send_response(201)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_two_threads_flushing_at_once_announce_each_version_once_in_order(
    slow_control_plane: tuple[str, list[int]],
) -> None:
    url, received = slow_control_plane
    with httpx.Client(base_url=url, timeout=10) as client:
        notifier = VersionNotifier(client, "run-a")
        notifier.pending = [PendingVersion(v, VersionKind.DELTA) for v in (1, 2, 3)]
        results: list[bool] = []
        errors: list[BaseException] = []

        def flush() -> None:
            try:
                results.append(notifier.flush())
            except BaseException as exc:  # an unguarded queue popped twice: IndexError
                errors.append(exc)

        threads = [threading.Thread(target=flush) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors == []
    assert results == [True, True]
    assert received == [1, 2, 3]
    assert notifier.pending == []
