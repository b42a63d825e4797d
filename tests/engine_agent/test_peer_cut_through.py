"""Cut-through forwarding (docs/peers.md): a peer passes a file on while it is still
receiving it, and the child still uses only bytes that match the store's digests.

Three real hops on 127.0.0.1: an upstream HTTP server that sends half of one shard and then
waits for the test to finish, cut or corrupt it; a parent (a store with its peer-file
cache served by the agent's real `PeerServer` under uvicorn) that fetches from that
upstream; a child that fetches from the parent. The child keeps its files for peers too, so
its own `PartialFile` shows the bytes it got before the parent had the whole file.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from engine_agent.peer_server import PeerServer
from engine_agent.status import AgentStatus
from store.layout import version_file_key
from store.manifest import INDEX_FILENAME
from store.partial_file import PartialFile
from store.sources import HttpSource, SourcedFetch
from store.sources.http import PARTIAL_HEADER, WAIT_HEADER
from store.store import Store
from store.tensors import RawTensor
from store.types import VersionRef
from tests.fixtures.processes import wait_until
from tests.store.chain import publish_chain, same_tensors
from wire import Role
from wire.peers import PEER_FILES_PATH

RUN = "cut-run"
DEADLINE_S = 60.0


@dataclass
class Upstream:
    """Serves the origin's files; `held` is sent half, then finished, cut or corrupted."""

    root: Path
    held: str
    half_sent: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    # "finish": the rest as stored; "cut": close the connection.
    ending: str = "finish"
    # Send the held file's first half damaged (a lying source).
    damaged: bool = False
    # Send nothing of the held file until released (a source several hops from the store
    # that is still waiting for the file itself); `half_sent` then means "asked".
    hold_first: bool = False
    url: str = ""


def start_upstream(upstream: Upstream) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            key = self.path.lstrip("/")
            data = (upstream.root / key).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if key != upstream.held:
                self.wfile.write(data)
                return
            half = 0 if upstream.hold_first else len(data) // 2
            first = bytes(b ^ 0x5A for b in data[:half]) if upstream.damaged else data[:half]
            self.wfile.write(first)
            self.wfile.flush()
            upstream.half_sent.set()
            upstream.release.wait(DEADLINE_S)
            if upstream.ending == "finish":
                self.wfile.write(data[half:])
            # "cut": return; the server closes the connection short of Content-Length.

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server


@contextlib.contextmanager
def serving_peer(store: Store, tweak: Callable[[PeerServer], None] | None = None) -> Iterator[str]:
    """`store`'s peer-file cache served by the agent's `PeerServer`: its files URL."""
    assert store.cache is not None

    async def engine_role(_authorization: str) -> Role | None:
        return Role.ENGINE

    server = PeerServer(
        cache=store.cache,
        run_id=RUN,
        status=AgentStatus(),
        role_of=engine_role,
        expecting=lambda _version: True,
        max_wait_s=DEADLINE_S,
        stall_s=DEADLINE_S,
        chunk_bytes=1024,
    )
    if tweak is not None:
        tweak(server)
    app = FastAPI()
    server.install(app)
    sock = socket.create_server(("127.0.0.1", 0))
    web = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: web.started, DEADLINE_S, "the peer server to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}{PEER_FILES_PATH}"
    finally:
        web.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()


class Catchup:
    """`store.materialize(RUN, 0)` from `source` in a thread, keeping what it returned."""

    def __init__(self, store: Store, source: HttpSource) -> None:
        self.store = store
        self.sourced = SourcedFetch([source])
        self.tensors: dict[str, RawTensor] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.tensors = self.store.materialize(RUN, 0, sources=self.sourced)
        except BaseException as exc:  # reported by `result`
            self.error = exc

    def result(self) -> dict[str, RawTensor]:
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "the catch-up did not finish"
        if self.error is not None:
            raise self.error
        assert self.tensors is not None
        return self.tensors

    def reasons(self) -> list[str]:
        return [fault.reason for fault in self.sourced.faults]


@dataclass
class Tree:
    origin: Path
    history: dict[int, dict[str, RawTensor]]
    upstream: Upstream
    parent: Store
    child: Store


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    origin = tmp_path / "origin"
    history = publish_chain(Store(str(origin)), RUN, "F")
    ref = VersionRef(RUN, 0)
    manifest = Store(str(origin)).read_manifest(ref)
    largest = max(
        manifest.shard_files(),
        key=lambda name: (origin / version_file_key(ref, name)).stat().st_size,
    )
    upstream = Upstream(origin, version_file_key(ref, largest))
    server = start_upstream(upstream)
    parent = Store(str(origin), cache_dir=tmp_path / "parent-files")
    child = Store(str(origin), cache_dir=tmp_path / "child-files")
    assert child.cache is not None
    child.cache.streams = True  # the child forwards too: its own arriving bytes are visible
    try:
        yield Tree(origin, history, upstream, parent, child)
    finally:
        upstream.release.set()
        server.shutdown()
        server.server_close()


def child_got_bytes_first(tree: Tree) -> None:
    """Wait until the child holds part of the held file while the parent is still waiting
    for the rest of it (so the parent cannot have forwarded a whole file)."""
    key = tree.upstream.held
    assert tree.upstream.half_sent.wait(DEADLINE_S), "the parent never asked the upstream"
    assert tree.child.cache is not None and tree.parent.cache is not None
    cache = tree.child.cache

    def received() -> bool:
        partial = cache.partial(key)
        return partial is not None and partial.received > 0

    wait_until(received, DEADLINE_S, "the child to receive the first half from its parent")
    assert tree.parent.cache.path(key) is None


def catch_up_through_parent(
    tree: Tree, tweak: Callable[[PeerServer], None] | None = None
) -> tuple[Catchup, Catchup]:
    """Parent and child catch up together; the upstream's held file is let go only once the
    child holds part of it. Both must end with the right tensors."""
    with serving_peer(tree.parent, tweak) as parent_url:
        parent = Catchup(tree.parent, HttpSource(tree.upstream.url, stall_s=30))
        child = Catchup(
            tree.child,
            HttpSource(parent_url, token="engine-token", kind="peer", wait_s=DEADLINE_S),
        )
        child_got_bytes_first(tree)
        tree.upstream.release.set()
        assert same_tensors(parent.result(), tree.history[0])
        assert same_tensors(child.result(), tree.history[0])
    return parent, child


def version_bytes(tree: Tree) -> int:
    """The size of every file of version 0 a catch-up reads (its shards and index)."""
    ref = VersionRef(RUN, 0)
    manifest = Store(str(tree.origin)).read_manifest(ref)
    return sum(
        (tree.origin / version_file_key(ref, name)).stat().st_size
        for name in [*manifest.shard_files(), INDEX_FILENAME]
    )


def test_a_child_receives_a_file_its_parent_is_still_receiving(tree: Tree) -> None:
    _parent, child = catch_up_through_parent(tree)
    assert child.reasons() == []
    assert child.sourced.bytes_from["store"] == 0
    assert child.sourced.bytes_from["peer"] > 0


def test_a_parent_whose_upstream_fails_mid_file_finishes_it_from_the_store_and_the_child_reads_on(
    tree: Tree,
) -> None:
    tree.upstream.ending = "cut"
    parent, child = catch_up_through_parent(tree)
    assert parent.reasons() == ["error"]
    # The parent read the rest from the store, from where its upstream stopped: the file
    # was never read twice, and the child's transfer went on. Before, the parent failed
    # the file, the child's transfer ended short and the child read the whole file from
    # the store (and so, in a tree, did every engine below it).
    assert parent.sourced.bytes_rejected == 0
    # Every byte read once: the held file's first half from the upstream, the rest (and
    # the files after the upstream was dropped) from the store.
    assert sum(parent.sourced.bytes_from.values()) == version_bytes(tree)
    assert child.reasons() == []
    assert child.sourced.bytes_rejected == 0
    assert child.sourced.bytes_from["store"] == 0


def test_a_file_half_lied_then_cut_is_read_again_from_the_store_with_no_one_blamed(
    tree: Tree,
) -> None:
    # The upstream damages the first half and then fails: the rest comes from the store,
    # the whole does not match, and it is read again from the store's first byte. Which
    # source's bytes were wrong is unknown, so none is reported for bad bytes.
    tree.upstream.ending = "cut"
    tree.upstream.damaged = True
    tree.upstream.release.set()
    parent = Catchup(tree.parent, HttpSource(tree.upstream.url, stall_s=30))
    assert same_tensors(parent.result(), tree.history[0])
    assert parent.reasons() == ["error"]
    held = (tree.origin / tree.upstream.held).stat().st_size
    assert parent.sourced.bytes_rejected == held


def test_a_parent_lying_mid_stream_is_caught_and_none_of_its_bytes_used(tree: Tree) -> None:
    def lie(server: PeerServer) -> None:
        """The parent forwards damaged bytes of the held file while its own copy stays good."""
        cache = server.cache
        receive = cache.receive

        def damaged(key: str, size: int) -> PartialFile:
            partial = receive(key, size)
            if key != tree.upstream.held:
                return partial
            write = partial.write
            partial.write = lambda chunk: write(bytes(b ^ 0x5A for b in chunk))  # type: ignore[method-assign]
            return partial

        cache.receive = damaged  # type: ignore[method-assign]

    _parent, child = catch_up_through_parent(tree, lie)
    assert child.reasons() == ["digest"]
    assert child.sourced.bytes_rejected > 0
    assert child.sourced.bytes_from["store"] > 0


@pytest.mark.parametrize(
    "hold_first",
    [True, False],
    ids=["before-the-first-byte", "once-bytes-flow"],
)
def test_a_forward_outlasts_a_pause_of_several_stall_times_in_its_agents_own_source(
    tree: Tree, hold_first: bool
) -> None:
    # The parent's own source sends nothing (before-the-first-byte), or half the file and
    # then nothing (once-bytes-flow), for several of the parent's stall times. Before the
    # first byte the child's wait holds (it asked to wait, as an agent does); after it, the
    # parent's own patience with its source (stall + wait): the parent keeps reading, so
    # its forward must stay open too.
    tree.upstream.hold_first = hold_first
    stall_s = 0.3
    servers: list[PeerServer] = []

    def quick_to_stall(server: PeerServer) -> None:
        server.stall_s = stall_s
        servers.append(server)

    with serving_peer(tree.parent, quick_to_stall) as parent_url:
        parent = Catchup(tree.parent, HttpSource(tree.upstream.url, stall_s=30))
        child = Catchup(
            tree.child,
            HttpSource(parent_url, token="engine-token", kind="peer", wait_s=DEADLINE_S),
        )
        if hold_first:
            assert tree.upstream.half_sent.wait(DEADLINE_S), "the parent never asked"
            wait_until(
                lambda: servers[0].uploading > 0, DEADLINE_S, "the parent to forward to the child"
            )
        else:
            child_got_bytes_first(tree)
        # The time under test (not a synchronisation): five of the parent's stall times
        # with nothing new to forward. The forward must still be open after them.
        time.sleep(5 * stall_s)
        assert servers[0].uploading > 0, "the forward ended during its source's pause"
        tree.upstream.release.set()
        assert same_tensors(parent.result(), tree.history[0])
        assert same_tensors(child.result(), tree.history[0])
    # Ending the forward at the stall time sent the child elsewhere ("unavailable").
    assert child.reasons() == []
    assert child.sourced.bytes_from["store"] == 0
    assert child.sourced.bytes_from["peer"] > 0


def test_bytes_forwarded_from_a_copy_that_then_failed_its_digest_are_thrown_away_not_continued(
    tree: Tree,
) -> None:
    # The parent's upstream lies in the first half: the parent forwards those bytes, then
    # finds the whole does not match and fails the file. The child must not continue from
    # the bytes it was forwarded (they are the lie): it starts the file over from its next
    # source. Before, it continued from them, found the whole wrong, and read the file again.
    tree.upstream.damaged = True
    parent, child = catch_up_through_parent(tree)
    held = (tree.origin / tree.upstream.held).stat().st_size
    assert parent.reasons() == ["digest"]
    assert "unavailable" in child.reasons()
    assert "digest" not in child.reasons()
    # Only what the parent forwarded before it failed the file was thrown away, not a
    # whole file assembled from two sources.
    assert 0 < child.sourced.bytes_rejected < held
    assert child.sourced.bytes_from["store"] >= held


def test_a_caller_that_leaves_a_forward_frees_the_upload_slot_while_the_bytes_are_awaited(
    tree: Tree,
) -> None:
    # The parent's own source sends nothing yet, so its forward to the caller waits for
    # bytes (for up to ten stall-plus-wait times). A caller that hangs up must free the
    # upload slot then, not when the bytes come or the patience runs out.
    tree.upstream.hold_first = True
    servers: list[PeerServer] = []
    with serving_peer(tree.parent, servers.append) as parent_url:
        parent = Catchup(tree.parent, HttpSource(tree.upstream.url, stall_s=30))
        assert tree.upstream.half_sent.wait(DEADLINE_S), "the parent never asked"
        port = int(parent_url.split(":")[2].split("/")[0])
        path = f"{PEER_FILES_PATH}/{tree.upstream.held}"
        caller = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
        caller.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer engine-token\r\n"
            f"{WAIT_HEADER}: {DEADLINE_S}\r\n\r\n".encode()
        )
        head = caller.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert f"{PARTIAL_HEADER.lower()}: 1".encode() in head.lower()
        wait_until(lambda: servers[0].uploading == 1, DEADLINE_S, "the forward to start")
        caller.close()
        wait_until(lambda: servers[0].uploading == 0, DEADLINE_S, "the slot to be freed")
        tree.upstream.release.set()
        assert same_tensors(parent.result(), tree.history[0])
    assert servers[0].status.served_files == 0
