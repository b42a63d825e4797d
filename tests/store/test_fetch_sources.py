"""Fetch sources: a catch-up reads a version's files from other places than the store (a
mirror, an HTTP distributor, a peer) and uses their bytes only when they match the digests
the store recorded; a source that serves bad bytes, fails or stalls is dropped, and the
store serves what is left."""

from __future__ import annotations

import contextlib
import functools
import http.server
import logging
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store.checksum import tensor_checksum
from store.layout import CLAIM_FILENAME, version_file_key
from store.manifest import INDEX_FILENAME as INDEX
from store.sources import HttpSource, ObjectSource, SourcedFetch
from store.sources.base import SourceFailed
from store.sources.http import PARTIAL_HEADER, open_client, shared_tls
from store.sources.sourced_fetch import FileDigest
from store.store import Store
from store.types import VersionRef
from tests.store.chain import publish_chain, same_tensors

RUN = "run-a"


@pytest.fixture
def origin(tmp_path: Path) -> tuple[Store, dict]:
    store = Store(str(tmp_path / "origin"))
    history = publish_chain(store, RUN, "FDD")
    return store, history


def mirror_of(origin: Store, tmp_path: Path, name: str = "mirror") -> Path:
    mirror = tmp_path / name
    shutil.copytree(origin.url.removeprefix("file://"), mirror)
    return mirror


def shards(store: Store, version: int) -> list[str]:
    return store.read_manifest(VersionRef(RUN, version)).shard_files()


def test_an_intact_mirror_serves_every_file_and_the_store_none(
    origin: tuple[Store, dict], tmp_path: Path
) -> None:
    store, history = origin
    mirror = mirror_of(store, tmp_path)
    sourced = SourcedFetch([ObjectSource.open(str(mirror))])
    tensors = store.materialize(RUN, 2, sources=sourced)
    assert same_tensors(tensors, history[2])
    assert sourced.bytes_from["objects"] > 0
    assert sourced.bytes_from["store"] == 0
    assert sourced.faults == []


def test_bytes_that_differ_from_the_store_digest_are_never_used(
    origin: tuple[Store, dict], tmp_path: Path
) -> None:
    store, history = origin
    mirror = mirror_of(store, tmp_path)
    shard = mirror / version_file_key(VersionRef(RUN, 1), shards(store, 1)[0])
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    sourced = SourcedFetch([ObjectSource.open(str(mirror))])
    tensors = store.materialize(RUN, 2, sources=sourced)
    assert same_tensors(tensors, history[2])
    assert [(f.reason, f.key) for f in sourced.faults] == [
        ("digest", version_file_key(VersionRef(RUN, 1), shards(store, 1)[0]))
    ]
    assert sourced.bytes_rejected == len(data)
    assert sourced.bytes_from["store"] > 0  # the dropped mirror's share came from the store
    assert sourced.sources == []


def test_a_version_without_a_claim_is_read_from_the_store_only(
    origin: tuple[Store, dict], tmp_path: Path
) -> None:
    store, history = origin
    mirror = mirror_of(store, tmp_path)
    for version in (0, 1, 2):  # as Stitch writes versions: no claim
        (Path(store.url.removeprefix("file://")) / version_file_key(
            VersionRef(RUN, version), CLAIM_FILENAME
        )).unlink()  # fmt: skip
        for name in shards(store, version):
            (mirror / version_file_key(VersionRef(RUN, version), name)).write_bytes(b"junk")
    sourced = SourcedFetch([ObjectSource.open(str(mirror))])
    assert same_tensors(store.materialize(RUN, 2, sources=sourced), history[2])
    assert sourced.bytes_from.get("objects", 0) == 0
    assert sourced.faults == []


@pytest.fixture
def http_mirror(origin: tuple[Store, dict], tmp_path: Path) -> Iterator[str]:
    """The mirror served by a static HTTP file server, as a cache or distributor would."""
    handler = functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(mirror_of(origin[0], tmp_path))
    )
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_an_http_distributor_serves_the_catch_up(
    origin: tuple[Store, dict], http_mirror: str
) -> None:
    store, history = origin
    sourced = SourcedFetch([HttpSource(http_mirror)])
    assert same_tensors(store.materialize(RUN, 2, sources=sourced), history[2])
    assert sourced.bytes_from["http"] > 0
    assert sourced.bytes_from["store"] == 0


def test_a_source_asked_from_an_offset_delivers_the_rest_with_or_without_ranges(
    origin: tuple[Store, dict], http_mirror: str, tmp_path: Path
) -> None:
    # Python's file server ignores `Range` (200 with the whole file): the source skips the
    # bytes before the offset itself. A mirror store reads the range.
    store, _history = origin
    ref = VersionRef(RUN, 2)
    key = version_file_key(ref, shards(store, 2)[0])
    whole = store.objects.get(key)
    mirror = ObjectSource.open(str(mirror_of(store, tmp_path, "ranged")))
    for source in (HttpSource(http_mirror), mirror):
        for offset in (0, 1, len(whole) // 2, len(whole) - 1):
            seen: list[bytes] = []
            rest = source.fetch(key, len(whole), seen.append, offset=offset)
            assert rest == whole[offset:]
            assert b"".join(seen) == whole[offset:]


def test_a_source_failing_mid_file_is_continued_by_the_next_from_where_it_stopped(
    origin: tuple[Store, dict], http_mirror: str
) -> None:
    # The first source cuts the file half way (Content-Length says more); the second is
    # asked only for the rest, and the whole is checked against the store's digest.
    store, _history = origin
    ref = VersionRef(RUN, 2)
    name = shards(store, 2)[0]
    key = version_file_key(ref, name)
    whole = store.objects.get(key)
    asked: list[int] = []
    rest = HttpSource(http_mirror)
    fetch_rest = rest.fetch

    def recorded(*args: Any, **kwargs: Any) -> bytes:
        asked.append(kwargs.get("offset", 0))
        return fetch_rest(*args, **kwargs)

    rest.fetch = recorded  # type: ignore[method-assign]
    received: list[bytes] = []
    with one_answer([whole[: len(whole) // 2]], len(whole)) as cut_url:
        sourced = SourcedFetch([HttpSource(cut_url), rest])
        digest = FileDigest(len(whole), tensor_checksum(whole))
        assert sourced.fetch(key, digest, received_into(received)) == whole
    assert b"".join(received) == whole  # one attempt, in order: readers read straight on
    assert asked == [len(whole) // 2]
    assert [f.reason for f in sourced.faults] == ["error"]
    assert sourced.bytes_from["http"] == len(whole)


@contextlib.contextmanager
def one_answer(
    pieces: list[bytes],
    length: int,
    gap_s: float = 0.0,
    head: bytes = b"",
    between: threading.Event | None = None,
) -> Iterator[str]:
    """A server on 127.0.0.1 answering one request: a 200 whose Content-Length says
    `length` (more header lines in `head`), then `pieces`, `gap_s` apart (or each after
    `between` is set), then the connection closed (short of `length` if the pieces are).
    Yields its URL."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n" % (length, head))
            # The reader may hang up before the last piece (what some tests check).
            with contextlib.suppress(OSError):
                for i, piece in enumerate(pieces):
                    if i:
                        (between or threading.Event()).wait(gap_s if between is None else 10)
                    conn.sendall(piece)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        thread.join(10)


def received_into(chunks: list[bytes]) -> Any:
    """An `Attempts` that keeps every byte written to it (all attempts in one list)."""

    class Kept:
        def sink(self) -> Any:
            return chunks.append

        def failed(self) -> None:
            chunks.append(b"<failed>")

        def verified(self) -> None:
            pass

    return Kept()


def test_a_source_that_never_answers_is_dropped_as_stalled_and_the_store_serves(
    origin: tuple[Store, dict],
) -> None:
    store, history = origin
    # A listening socket nobody accepts from: connections open, no byte ever comes back.
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        stalled = HttpSource(f"http://127.0.0.1:{silent.getsockname()[1]}", stall_s=0.3)
        sourced = SourcedFetch([stalled])
        assert same_tensors(store.materialize(RUN, 2, sources=sourced), history[2])
    finally:
        silent.close()
    assert [f.reason for f in sourced.faults] == ["stall"]
    assert "stalled before answering" in sourced.faults[0].message
    assert sourced.bytes_from["store"] > 0


def test_a_file_whose_last_bytes_arrive_after_the_deadline_is_kept_not_called_a_stall() -> None:
    # Three pieces 1.5 s apart (each gap well within the 2.5 s stall limit), the last one
    # after the overall deadline (stall_s plus size at min_bytes_per_s, about 2.5 s). Before,
    # the whole file was thrown away as "delivered 99 of 99 bytes before its deadline" (seen
    # in a 1,000-engine fleet on slow links: whole subtrees of the fetch tree then read the
    # store). A transfer still short at the deadline stays a stall.
    body = bytes(range(99))
    received: list[bytes] = []
    pieces = [body[at : at + 33] for at in range(0, len(body), 33)]
    with one_answer(pieces, len(body), gap_s=1.5) as url:
        slow = HttpSource(url, stall_s=2.5, min_bytes_per_s=1e12)
        assert slow.fetch("key", len(body), sink=received.append) == body
    assert b"".join(received) == body


@pytest.mark.parametrize("forward", [True, False], ids=["a-forward", "a-file-on-disk"])
def test_a_forward_may_pause_while_its_server_changes_source_a_file_on_disk_may_not(
    forward: bool,
) -> None:
    # Half a file, then a pause of twice the source's stall limit (stall + wait), then the
    # rest. From a peer forwarding a file it is still receiving, the pause is that peer's
    # own source timing out and the next one taking over; the child waited the same 35 s
    # as its parent and so gave up the moment before the bytes came back (a cascade of
    # 110 stalls in a minute down one subtree, 1,000 engines on slow links). A file
    # served whole from disk that pauses so long is still a stall.
    # The forward's pause is a fixed 1 s against its 10 s patience; the file on disk's
    # rest comes only once the reader has given up, so neither depends on how busy the
    # machine is.
    body = bytes(range(100))
    head = b"%s: 1\r\n" % PARTIAL_HEADER.encode() if forward else b""
    gave_up = threading.Event()
    between = None if forward else gave_up
    with one_answer([body[:50], body[50:]], len(body), 1.0, head, between) as url:
        source = HttpSource(url, stall_s=0.3, wait_s=0.2, forward_stall_s=10.0,
                            min_bytes_per_s=1e12)  # fmt: skip
        if forward:
            assert source.fetch("key", len(body)) == body
        else:
            with pytest.raises(SourceFailed) as failed:
                source.fetch("key", len(body))
            gave_up.set()
            assert failed.value.reason == "stall"
            assert "stalled after 50 of 100 bytes (" in str(failed.value)
            assert "went silent" in str(failed.value)


def test_a_fetch_closed_under_a_running_read_does_not_log_its_source_as_faulty(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An agent stopping mid catch-up closes its fetches' HTTP client under worker threads
    # still reading: 346 "dropped fetch source ... Bad file descriptor" warnings when a
    # 1,000-engine bench stopped, each naming a peer that had done nothing wrong.
    body = bytes(range(99))
    pieces = [body[at : at + 33] for at in range(0, len(body), 33)]
    first = threading.Event()
    got: list[bytes | None] = []

    class Signalled:
        def sink(self) -> Any:
            return lambda chunk: first.set()

        def failed(self) -> None:
            pass

        def verified(self) -> None:
            pass

    # The second piece comes only once the fetch is closed: the read after it fails.
    closed = threading.Event()
    with one_answer(pieces, len(body), between=closed) as url:
        sourced = SourcedFetch([HttpSource(url, stall_s=5.0, min_bytes_per_s=1e12)])
        digest = FileDigest(len(body), tensor_checksum(body))
        reading = threading.Thread(target=lambda: got.append(
            sourced.fetch("key", digest, Signalled())))  # fmt: skip
        with caplog.at_level(logging.DEBUG, "store.sources.sourced_fetch"):
            reading.start()
            assert first.wait(10)
            sourced.close()
            closed.set()
            reading.join(10)
    assert got == [None]  # nothing used: the reader goes to the store, or stops
    assert [f.reason for f in sourced.faults] == ["error"]
    levels = [r.levelno for r in caplog.records if "fetch source" in r.getMessage()]
    assert levels == [logging.DEBUG]


def test_a_source_that_does_not_hold_a_file_is_a_miss_not_a_fault(
    origin: tuple[Store, dict], tmp_path: Path
) -> None:
    store, history = origin
    empty = tmp_path / "empty"
    empty.mkdir()
    sourced = SourcedFetch([ObjectSource.open(str(empty))])
    assert same_tensors(store.materialize(RUN, 2, sources=sourced), history[2])
    assert sourced.faults == []
    assert len(sourced.sources) == 1


def test_opening_an_http_source_loads_no_certificates_and_leaves_a_shared_client_open() -> None:
    # Loading the CA bundle takes 0.1-0.3 s of CPU under the GIL: built per peer per pass,
    # it stalled a swarm of agents' event loop for seconds. Plain-HTTP sources load none;
    # TLS ones share the one context of the process.
    shared_tls.cache_clear()
    own = HttpSource("http://127.0.0.1:9/files")
    shared = open_client()
    borrowing = HttpSource("http://127.0.0.1:9/files", token="t", wait_s=3, client=shared)
    with pytest.raises(SourceFailed):
        borrowing.fetch("key", 1)  # nobody listens on port 9: refused, no TLS involved
    assert shared_tls.cache_info().currsize == 0
    # The one client for plain and TLS origins builds the process's context when asked.
    assert shared._client().ssl_context() is shared_tls()
    assert shared_tls.cache_info().currsize == 1
    borrowing.close()
    own.close()
    assert not shared.is_closed
    assert own._client.is_closed
    shared.close()


def test_each_file_is_asked_of_its_lanes_source_first_and_files_arrive_side_by_side(
    origin: tuple[Store, dict], tmp_path: Path, http_mirror: str
) -> None:
    # Peer fetch over two trees: a version's files are dealt out to the lanes by their place
    # among the files the claim records, so each engine takes half its files from each parent.
    store, history = origin
    mirror = ObjectSource.open(str(mirror_of(store, tmp_path, "second-mirror")))
    http = HttpSource(http_mirror)
    sourced = SourcedFetch([], lanes=[[mirror], [http]])
    assert same_tensors(store.materialize(RUN, 2, sources=sourced), history[2])
    expected = {"objects": 0, "http": 0}
    for version in (0, 1, 2):
        for place, (_, digest) in enumerate(
            sorted(store.file_digests(VersionRef(RUN, version)).items())
        ):
            expected["objects" if place % 2 == 0 else "http"] += digest.size
    assert expected["http"] > 0
    assert dict(sourced.bytes_from) == expected
    assert sourced.faults == []
    # A file is never asked of another lane's peers (there they may be its descendants,
    # waiting for it from this engine); sources of no lane come after the lane's.
    cache = ObjectSource.open(str(mirror_of(store, tmp_path, "cache")))
    laned = SourcedFetch([cache], lanes=[[mirror], [http]])
    assert laned.order(lane=0) == [mirror, cache]
    assert laned.order(lane=3) == [http, cache]
    laned._drop(http, "k", "error", "gone")
    assert laned.order(lane=1) == [cache]
    # An earlier version's files follow that version's own lanes where the fetch has them
    # (its trees may rank this engine's peers otherwise); the other versions the target's.
    http_again = HttpSource(http_mirror)
    swapped = {1: [[HttpSource(http_mirror)], [mirror]]}
    by_version = SourcedFetch([], lanes=[[mirror], [http_again]], by_version=swapped)
    assert same_tensors(store.materialize(RUN, 2, sources=by_version), history[2])
    expected = {"objects": 0, "http": 0}
    for version in (0, 1, 2):
        for place, (_, digest) in enumerate(
            sorted(store.file_digests(VersionRef(RUN, version)).items())
        ):
            expected["objects" if (place % 2 == 0) != (version == 1) else "http"] += digest.size
    assert dict(by_version.bytes_from) == expected
    assert by_version.order(lane=0, version=1) == swapped[1][0]
    assert by_version.order(lane=1, version=2) == [http_again]


def test_a_source_unavailable_for_one_file_is_kept_for_the_others_once(
    origin: tuple[Store, dict],
) -> None:
    # A busy peer (503) may serve the next file; a second time in the same fetch it is
    # dropped like any failing source.
    store, _ = origin

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        busy = HttpSource(f"http://127.0.0.1:{server.server_address[1]}")
        ref = VersionRef(RUN, 1)
        digests = store.file_digests(ref)
        names = sorted(digests)
        sourced = SourcedFetch([busy])
        assert sourced.fetch(version_file_key(ref, names[0]), digests[names[0]]) is None
        assert sourced.sources == [busy]
        assert sourced.fetch(version_file_key(ref, names[1]), digests[names[1]]) is None
        assert sourced.sources == []
        assert [f.reason for f in sourced.faults] == ["unavailable", "unavailable"]
        sourced.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class Recorded(ObjectSource):
    """A mirror that records the keys it is asked for, in order, and how many it serves at
    once; `hold(key)` runs before it serves `key`."""

    def __init__(self, objects: Any, lock: threading.Lock, hold: Any = None) -> None:
        super().__init__(objects)
        self.asked: list[str] = []
        self.serving = self.most = 0
        self._lock = lock
        self._hold = hold

    def fetch(self, key: str, size: int, sink: Any = None, offset: int = 0) -> bytes:
        with self._lock:
            self.asked.append(key)
            self.serving += 1
            self.most = max(self.most, self.serving)
        try:
            if self._hold is not None:
                self._hold(key)
            return super().fetch(key, size, sink, offset)
        finally:
            with self._lock:
                self.serving -= 1


def test_each_lane_fetches_the_whole_chain_one_file_at_a_time_without_waiting_for_the_other(
    origin: tuple[Store, dict], tmp_path: Path
) -> None:
    # One worker per lane over every version of the catch-up: a lane never fetches two files
    # at once (they would share its parent's upload), takes each version's index before its
    # shards, and goes on to the next version while the other lane still fetches this one.
    # Fetched a version at a time, each version ended with one lane idle.
    store, history = origin
    lock = threading.Lock()
    ahead = threading.Event()
    chain = (0, 1, 2)
    # The claim's files by place; each lane's share in the order it fetches them.
    places = {v: sorted(store.file_digests(VersionRef(RUN, v))) for v in chain}

    def share(v: int, lane: int) -> list[str]:
        mine = [name for place, name in enumerate(places[v]) if place % 2 == lane]
        ordered = sorted(mine, key=lambda name: name.endswith(".safetensors"))
        return [version_file_key(VersionRef(RUN, v), name) for name in ordered]

    held_back: list[str] = []

    def wait_for_the_other_lane(key: str) -> None:
        if key == share(1, 0)[-1]:  # lane 0's last file of version 1
            held_back.append(key)
            assert ahead.wait(30), "the other lane waited for this one to finish version 1"

    mirror = mirror_of(store, tmp_path)
    lane0 = Recorded(ObjectSource.open(str(mirror)).objects, lock, wait_for_the_other_lane)
    lane1 = Recorded(ObjectSource.open(str(mirror)).objects, lock, None)

    def noted(key: str) -> None:
        if "weight_v000002" in key:
            ahead.set()

    lane1._hold = noted
    progress: list[str] = []
    tensors = store.materialize(
        RUN, 2, sources=SourcedFetch([], lanes=[[lane0], [lane1]]),
        progress=lambda done, total, what: progress.append(what),
    )  # fmt: skip
    assert same_tensors(tensors, history[2])
    assert held_back and ahead.is_set()
    assert lane0.most == 1 and lane1.most == 1
    for lane, source in enumerate((lane0, lane1)):
        assert source.asked == [key for v in chain for key in share(v, lane)]
    assert any(key.endswith(INDEX) for key in lane0.asked + lane1.asked)
    assert progress == [f"fetched {RUN} v{v}" for v in chain] + [f"folded {RUN} v2"]


def test_a_source_the_environment_proxies_is_fetched_through_the_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tether's own client speaks no proxy protocol: a URL that HTTP_PROXY covers goes
    # through httpx, which does. The proxy answers for a peer that does not exist.
    body = b"through the proxy"
    heads: list[bytes] = []
    proxy = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = proxy.accept()
        with conn:
            heads.append(conn.recv(65536))
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.setenv("NO_PROXY", "")
    try:
        source = HttpSource("http://peer.invalid:8000/files", token="t")
        assert source.fetch("key", len(body)) == body
        source.close()
    finally:
        proxy.close()
    assert heads and heads[0].startswith(b"GET http://peer.invalid:8000/files/key HTTP/1.1")
    assert b"authorization: bearer t" in heads[0].lower()
