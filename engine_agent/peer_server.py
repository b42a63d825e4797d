"""Serving the version files this agent holds to its peers (docs/peers.md).

`GET /v1/peer/files/{key}` answers the verified copy of a store key from the agent's file
cache (what its catch-ups fetched), with single-range reads (`Range: bytes=a-b`). Callers
must hold an engine (or admin) token, checked with the control plane and remembered for a
short while. A file the agent is still receiving is forwarded as its bytes arrive (cut-
through: `store.partial_file`; chunked, marked `X-Tether-Peer-Partial: 1`, its last byte
held back until the agent verified the file; a source of the agent's that fails mid-file is
continued by its next one from the same offset, so the forward goes on; it ends short if
the file fails its digest, or, as a safety net, delivers nothing for ten times
`stall_s + max_wait_s`, before the first byte or after it). A file the agent will
fetch (its version lies between the applied version and its target) is waited for, at most
as long as the caller allows (`X-Tether-Peer-Wait`) and the agent's own `peer_wait_s`;
otherwise a missing file is 404 at once. Uploads are bounded: `upload_slots` under way at a
time (503 past that) sharing `upload_bytes_per_s`. Old versions are pruned from the cache
after each commit.

Must never complete a transfer of anything but verified version files of its own run (no
claim, no pointer, no path outside the cache), never change weights and never log a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_agent.status import AgentStatus
from store.cache import FileCache
from store.errors import InvalidName
from store.layout import CLAIM_FILENAME, validate_file_name
from store.partial_file import FAILED, PartialFile
from store.sources.http import PARTIAL_HEADER, WAIT_HEADER
from store.types import parse_version_dir_name
from wire import ErrorBody, ErrorDetail, Role
from wire.peers import PEER_FILES_PATH

log = logging.getLogger(__name__)

_CHUNK = 256 * 1024
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
# How long a token's role, as the control plane answered it, is trusted.
_ROLE_CACHE_S = 30.0
_PEER_ROLES = frozenset({Role.ENGINE, Role.ADMIN})

# authorization header -> the token's role (None: unknown token).
RoleLookup = Callable[[str], Awaitable[Role | None]]


def _error(status: int, kind: str, message: str, retry_after: int | None = None) -> Response:
    body = ErrorBody(error=ErrorDetail(type=kind, message=message)).model_dump_json()
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return Response(body, status_code=status, media_type="application/json", headers=headers)


class UploadLimiter:
    """Paces the bytes of every upload together to `bytes_per_s` (0: no limit)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._next = 0.0

    async def take(self, size: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = time.monotonic()
        start = max(now, self._next)
        self._next = start + size / self.bytes_per_s
        if start > now:
            await asyncio.sleep(start - now)


# Once bytes flow, a forward outlasts this many of the agent's own source timeouts
# (`stall_s + max_wait_s`) without news: the agent's fetch settles the file long before.
_OWNER_PATIENCE = 10


class PeerServer:
    """The peer file route of one agent; `install(app)` before the proxy's catch-all."""

    def __init__(
        self,
        *,
        cache: FileCache,
        run_id: str,
        status: AgentStatus,
        role_of: RoleLookup,
        expecting: Callable[[int], bool],
        max_wait_s: float = 30.0,
        upload_slots: int = 8,
        upload_bytes_per_s: float = 0.0,
        stall_s: float = 5.0,
        chunk_bytes: int = _CHUNK,
    ) -> None:
        self.cache = cache
        self.run_id = run_id
        self.status = status
        self.role_of = role_of
        self.expecting = expecting
        self.max_wait_s = max_wait_s
        self.upload_slots = upload_slots
        self.stall_s = stall_s
        # Uploads are paced and forwarded in pieces of this size: small pieces let a
        # parent's children share its upload and pass each piece on as it comes.
        self.chunk_bytes = max(1, min(chunk_bytes, _CHUNK))
        # Uploads under way; counted inside the streaming body so that a client that leaves
        # before the body starts never holds a slot.
        self.uploading = 0
        self.limiter = UploadLimiter(upload_bytes_per_s)
        self._roles: dict[str, tuple[Role | None, float]] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        cache.on_saved = self._saved_from_thread
        cache.on_receiving = self._saved_from_thread
        cache.streams = True
        cache.chunk_bytes = max(1, chunk_bytes)

    def install(self, app: FastAPI) -> None:
        """Serve `GET PEER_FILES_PATH/<key>` on `app`, ahead of its routing (`_PeerFront`)."""
        app.add_middleware(_PeerFront, server=self)

    # ---- auth ----------------------------------------------------------------------------

    async def _allowed(self, authorization: str | None) -> Response | None:
        """None if the caller may fetch files, else the 401/403/503 to answer."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return _error(401, "Unauthorized", "send 'Authorization: Bearer <engine token>'")
        digest = hashlib.sha256(authorization.encode()).hexdigest()
        entry = self._roles.get(digest)
        if entry is None or entry[1] < time.monotonic():
            try:
                found = await self.role_of(authorization)
            except Exception as exc:  # no control plane answers: cannot check, so refuse
                log.warning("peer token check failed: %s", type(exc).__name__)
                return _error(503, "ControlPlaneUnavailable", "cannot check the token now", 1)
            if len(self._roles) > 10_000:
                self._roles.clear()
            entry = (found, time.monotonic() + _ROLE_CACHE_S)
            self._roles[digest] = entry
        role = entry[0]
        if role is None:
            return _error(401, "Unauthorized", "unknown bearer token")
        if role not in _PEER_ROLES:
            return _error(403, "Forbidden", f"a {role.value} token may not fetch peer files")
        return None

    # ---- files ---------------------------------------------------------------------------

    def _version_of(self, key: str) -> int:
        """The version of a servable key `<run>/updates/weight_vNNNNNN/<file>`, else
        `InvalidName`."""
        parts = key.split("/")
        if len(parts) != 4 or parts[0] != self.run_id or parts[1] != "updates":
            raise InvalidName(f"{key!r} is not a version file of run {self.run_id!r}")
        version = parse_version_dir_name(parts[2])
        if validate_file_name(parts[3]) == CLAIM_FILENAME:
            raise InvalidName("the claim is read from the store, never from a peer")
        return version

    def _saved_from_thread(self, key: str) -> None:
        if self._loop is not None and key in self._waiters:
            self._loop.call_soon_threadsafe(self._saved, key)

    def _saved(self, key: str) -> None:
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(None)

    def _held(self, key: str) -> Path | PartialFile | None:
        """The cached file of `key`, else the attempt at it under way, else None."""
        return self.cache.path(key) or self.cache.partial(key)

    async def _wait_for(self, key: str, version: int, wait_s: float) -> Path | PartialFile | None:
        """The cached file of `key` or its arriving bytes, waiting up to `wait_s` while this
        agent is about to fetch it."""
        deadline = time.monotonic() + wait_s
        while True:
            held = self._held(key)
            left = deadline - time.monotonic()
            if held is not None or left <= 0 or not self.expecting(version):
                return held
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(key, []).append(waiter)
            # Re-check after registering: the file may have landed in between.
            if self._held(key) is not None:
                continue
            # Bounded slices: the agent may stop expecting the file (a failed pass).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, min(left, 1.0))

    async def serve(self, headers: dict[str, str], key: str) -> Response:
        """The answer to a GET of `key`; `headers`: the request's, names in lower case."""
        refused = await self._allowed(headers.get("authorization"))
        if refused is not None:
            return refused
        try:
            version = self._version_of(key)
        except InvalidName as exc:
            return _error(404, "NotFound", str(exc))
        self._loop = asyncio.get_running_loop()
        try:
            asked = float(headers.get(_WAIT, "0"))
        except ValueError:
            asked = 0.0
        wait_s = max(0.0, min(asked, self.max_wait_s))
        held = await self._wait_for(key, version, wait_s)
        if held is None:
            return _error(404, "NotFound", f"this agent holds no verified copy of {key}")
        if self.uploading >= self.upload_slots:
            return _error(503, "PeerBusy", "every upload slot is taken; ask another source", 1)
        if isinstance(held, PartialFile):
            return self._forward(held, headers.get("range"))
        path = held
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # pruned meanwhile
            return _error(404, "NotFound", f"{key} was pruned")
        return _ranged(
            headers.get("range"),
            size,
            {"Content-Length": ""},
            lambda start, end: self._stream(path, start, end),
        )

    def _forward(self, partial: PartialFile, wanted: str | None) -> Response:
        """Stream a file this agent is still receiving (no length: it may end short)."""
        return _ranged(
            wanted,
            partial.size,
            {PARTIAL_HEADER: "1"},
            lambda start, end: self._stream_partial(partial, start, end),
        )

    async def _stream_partial(
        self, partial: PartialFile, start: int, end: int
    ) -> AsyncIterator[bytes]:
        """The bytes [start, end) of `partial` as they arrive. The first of them may be
        slow: this agent's own source may be a peer still waiting for the file itself,
        several hops from the store. After that, news may be as far apart as this agent's
        own fetch lets its source's bytes be: a source may send nothing for
        `stall_s` plus the wait it was granted before it counts as failed, and the next
        one continues the file from the same offset (`PartialFile`), perhaps after a wait
        of its own. So the forward ends when the file fails (the agent's fetch of it always
        settles it: verified, failed or abandoned), and only as a safety net after
        `_OWNER_PATIENCE` times `stall_s + max_wait_s` without news, before the first byte
        as after it (longer than any caller's wait, at most `max_wait_s`). A child throws away
        what a forward that ended short gave it (it may be a lie that failed here), so a
        forward ended at the same 35 s as this agent's own source timed out made whole
        subtrees start over (4,311 in a 1,000-engine run on slow links). Ending
        either wait at `stall_s` sent callers elsewhere while the bytes were on their way:
        about 2,200 forwards before the first byte in a 1,000-engine bench run, and 5,478
        after it on slow links, each file then read again from another source."""
        self.uploading += 1
        try:
            offset = start
            while offset < end:
                ready = min(partial.readable(), end)
                if partial.state == FAILED:
                    return  # short: the caller reads elsewhere
                if ready > offset:
                    chunk = partial.read(offset, min(ready, offset + self.chunk_bytes))
                    await self.limiter.take(len(chunk))
                    offset += len(chunk)
                    self.status.served_bytes += len(chunk)
                    yield chunk
                    continue
                patience = _OWNER_PATIENCE * (self.stall_s + self.max_wait_s)
                if not await partial.wait(offset, patience):
                    log.info("%s delivered nothing for %.1fs; ending its forward", partial.key,
                             patience)  # fmt: skip
                    return
            self.status.served_files += 1
        finally:
            self.uploading -= 1

    async def _stream(self, path: Path, start: int, end: int) -> AsyncIterator[bytes]:
        self.uploading += 1
        try:
            with path.open("rb") as handle:
                handle.seek(start)
                left = end - start
                while left > 0:
                    # One thread hop per block read (up to `_CHUNK`), sent in paced pieces of
                    # `chunk_bytes`: a hop per small piece cost more than sending it.
                    block = await asyncio.to_thread(handle.read, min(_CHUNK, left))
                    if not block:
                        break
                    left -= len(block)
                    for at in range(0, len(block), self.chunk_bytes):
                        chunk = block[at : at + self.chunk_bytes]
                        await self.limiter.take(len(chunk))
                        self.status.served_bytes += len(chunk)
                        yield chunk
            self.status.served_files += 1
        finally:
            self.uploading -= 1

    # ---- retention -----------------------------------------------------------------------

    def prune(self, applied: int, keep_versions: int) -> None:
        """Drop cached files of versions more than `keep_versions` - 1 below `applied`."""
        updates = self.cache.root / self.run_id / "updates"
        if not updates.is_dir():
            return
        for folder in updates.iterdir():
            try:
                version = parse_version_dir_name(folder.name)
            except InvalidName:
                continue
            if version <= applied - keep_versions:
                shutil.rmtree(folder, ignore_errors=True)


_WAIT = WAIT_HEADER.lower()
_READ_HEADERS = frozenset({b"authorization", b"range", _WAIT.encode("latin-1")})


class _PeerFront:
    """An ASGI layer that answers peer file GETs before the app's router: FastAPI's route
    matching, parameter solving and exception layers cost more per request than serving a
    small file's pieces (a 1,000-agent swarm spent a few per cent of its CPU in them). Every
    other request goes on to the app."""

    def __init__(self, app: ASGIApp, server: PeerServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope["method"] == "GET" and path.startswith(_PREFIX):
            # The few headers it reads, straight from the scope (ASGI names are lower
            # case): a Starlette `Request` and its `Headers` were ~5 % of a swarm's CPU.
            headers = {
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in scope["headers"]
                if name in _READ_HEADERS
            }
            response = await self.server.serve(headers, path[len(_PREFIX) :])
            if isinstance(response, StreamingResponse):
                await send_stream(response, receive, send)
            else:
                await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def send_stream(response: StreamingResponse, receive: Receive, send: Send) -> None:
    """Send `response` as Starlette does, ending it (and its body generator, which frees
    the upload slot) as soon as the caller leaves, even while the body waits for bytes. One
    plain task watches for the caller leaving: Starlette's anyio task group, cancel scope
    and events per answer (for a server of ASGI spec 2.3, as uvicorn's is) were about 7 %
    of a 1,000-agent swarm's CPU (`bench/http_cost.py` measures both ways)."""
    task = asyncio.current_task()
    assert task is not None
    body = response.body_iterator
    state = {"sent": False, "left": False}

    def caller_left(watch: asyncio.Future[None]) -> None:
        if not state["sent"] and not watch.cancelled() and watch.exception() is None:
            state["left"] = True
            task.cancel()

    watch = asyncio.ensure_future(_until_disconnect(receive))
    watch.add_done_callback(caller_left)
    try:
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": response.raw_headers,
            }
        )
        async for chunk in body:
            data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not state["left"]:
            raise
        task.uncancel()
    finally:
        # The watch may have finished with its callback already scheduled: it must not
        # cancel this task once the answer is over (below, or in the caller).
        state["sent"] = True
        watch.remove_done_callback(caller_left)
        watch.cancel()
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


_PREFIX = PEER_FILES_PATH + "/"


def _ranged(
    wanted: str | None,
    size: int,
    headers: dict[str, str],
    body: Callable[[int, int], AsyncIterator[bytes]],
) -> Response:
    """The answer streaming `body(start, end)` for the `Range` header `wanted` (200 for the
    whole file, 206 for a single range, 416 for anything else); a `Content-Length` entry in
    `headers` is filled in."""
    start, end, status = 0, size, 200
    if wanted:
        span = _parse_range(wanted, size)
        if span is None:
            return Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
        start, end, status = span[0], span[1], 206
    headers = {**headers, "Accept-Ranges": "bytes"}
    if "Content-Length" in headers:
        headers["Content-Length"] = str(end - start)
    if status == 206:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    return StreamingResponse(
        body(start, end), status_code=status, headers=headers, media_type="application/octet-stream"
    )


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=a-b` / `bytes=a-` / `bytes=-n` range, else None."""
    match = _RANGE.match(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if first == "" and last == "":
        return None
    if first == "":
        length = int(last)
        return (max(0, size - length), size) if length > 0 else None
    start = int(first)
    end = min(int(last) + 1, size) if last else size
    return (start, end) if start < end else None
