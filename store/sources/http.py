"""`HttpSource`: version files over plain HTTP GET, from a peer agent or a distributor.

`GET {base_url}/{key}` must answer the object's bytes (200), or 404 when the server does
not hold it. That is what a peer agent's file route speaks, and what an HTTP cache in front
of the bucket, a Dragonfly or Kraken proxy, or any static file server offers. A bearer
token is sent when given (peers require the engine role). Never verifies bytes (the caller
does) and never logs the token.

Deadlines: a server may hold a request while it fetches the file itself (a peer still
catching up; the wait it may take is sent in `WAIT_HEADER`). After that, a transfer that
delivers nothing for `stall_s`, or that runs slower than `min_bytes_per_s` overall, is a
stall: `SourceFailed("stall")`, and the caller moves on. A file whose last byte has arrived
is never a stall: its bytes are kept, however late they came. A forward (a peer passing on
a file it is still receiving, `PARTIAL_HEADER`) may be silent for `forward_stall_s`
instead: its pauses are its server's own source recovering, which takes that source's
whole timeout and then the next source's first byte.

Clients: every source of an agent shares one `FetchClient` (keep-alive to the same parents
across passes). It reads through Tether's blocking HTTP/1.1 client (`http1.blocking`): in
a swarm of agents, httpx's sync client cost a quarter of the process's GIL time, most of
it reading bodies in small paced pieces. A URL the environment routes through a proxy
(`HTTP(S)_PROXY`, `ALL_PROXY`, unless `NO_PROXY` names the host) goes through httpx, which
speaks to proxies. TLS uses one process-wide context, built on first use: loading the CA
bundle costs 0.1-0.3 s of CPU holding the GIL, and a fleet's catch-ups start together.
"""

from __future__ import annotations

import contextlib
import functools
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import httpx

from http1.blocking import BlockingClient
from http1.client import UpstreamError, UpstreamTimeout, proxied
from store.sources.base import FetchSource, SourceFailed

# How long (seconds) the server may hold the request for a file it is still fetching.
WAIT_HEADER = "X-Tether-Peer-Wait"
# Set by a peer on an answer that forwards a file it is still receiving: such an answer may
# end short when the peer's own source fails, which makes the peer unavailable for this
# pass, not faulty.
PARTIAL_HEADER = "X-Tether-Peer-Partial"


@functools.cache
def shared_tls() -> ssl.SSLContext:
    """The one TLS context every fetch source's client uses (httpx's default settings)."""
    return httpx.create_ssl_context()


class _Answer(Protocol):
    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def set_read_timeout(self, seconds: float) -> None: ...

    def iter_bytes(self) -> Iterator[bytes]: ...


class FetchClient:
    """The HTTP client fetch sources share: a GET streamed piece by piece, failures as
    `UpstreamError` (`UpstreamTimeout` for a silence). Thread-safe; cheap to open."""

    def __init__(self, connect_s: float = 2.0) -> None:
        self.connect_s = connect_s
        self._lock = threading.Lock()
        self._direct: BlockingClient | None = None
        self._proxied: httpx.Client | None = None
        # Whether each origin goes through a proxy, decided from the environment once (as
        # httpx does when a client opens): reading it costs more than the rest of a GET.
        self._through_proxy: dict[str, bool] = {}
        self.is_closed = False

    @contextlib.contextmanager
    def get(self, url: str, headers: dict[str, str], read_s: float) -> Iterator[_Answer]:
        """GET `url`, the answer's head in hand; its body is read inside the block."""
        scheme, _, rest = url.partition("://")
        origin = f"{scheme}://{rest.split('/', 1)[0]}"
        through_proxy = self._through_proxy.get(origin)
        if through_proxy is None:
            through_proxy = self._through_proxy[origin] = proxied(url)
        if through_proxy:
            with self._get_proxied(url, headers, read_s) as reply:
                yield reply
            return
        with self._client().stream(url, headers, read_timeout_s=read_s) as answer:
            yield answer

    def close(self) -> None:
        """Close every connection, those of reads under way too (they fail at once)."""
        with self._lock:
            self.is_closed = True
            direct, self._direct = self._direct, None
            proxy_client, self._proxied = self._proxied, None
        if direct is not None:
            direct.close()
        if proxy_client is not None:
            proxy_client.close()

    def _client(self) -> BlockingClient:
        client = self._direct
        if client is None:
            with self._lock:
                if self.is_closed:
                    raise UpstreamError("the fetch client is closed")
                client = self._direct
                if client is None:
                    # One client for plain and TLS origins; the process's TLS context is
                    # built at its first https connection, never for plain HTTP.
                    client = self._direct = BlockingClient(
                        connect_timeout_s=self.connect_s, ssl_context=shared_tls
                    )
        return client

    @contextlib.contextmanager
    def _get_proxied(self, url: str, headers: dict[str, str], read_s: float) -> Iterator[_Answer]:
        with self._lock:
            if self.is_closed:
                raise UpstreamError("the fetch client is closed")
            if self._proxied is None:
                self._proxied = httpx.Client(
                    verify=shared_tls(), timeout=httpx.Timeout(30.0, connect=self.connect_s)
                )
            client = self._proxied
        timeout = httpx.Timeout(read_s, connect=self.connect_s)
        try:
            with client.stream("GET", url, headers=headers, timeout=timeout) as reply:
                yield _HttpxAnswer(reply)
        except UpstreamTimeout as exc:
            raise UpstreamTimeout(f"{type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc


class _HttpxAnswer:
    def __init__(self, reply: httpx.Response) -> None:
        self.status = reply.status_code
        self.headers = reply.headers
        self._reply = reply

    def set_read_timeout(self, seconds: float) -> None:
        # httpcore takes a body's read timeout from the request's `timeout` extension when
        # the body is first read, so one set here holds for this body alone.
        timeouts = self._reply.request.extensions.get("timeout")
        if isinstance(timeouts, dict):
            self._reply.request.extensions["timeout"] = {**timeouts, "read": seconds}

    def iter_bytes(self) -> Iterator[bytes]:
        return self._reply.iter_bytes()


def open_client(connect_s: float = 2.0) -> FetchClient:
    """A client for fetch sources, to share between them."""
    return FetchClient(connect_s)


class HttpSource(FetchSource):
    """Fetches `{base_url}/{key}` with a bounded wait and stall detection."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        kind: str = "http",
        wait_s: float = 0.0,
        stall_s: float = 5.0,
        min_bytes_per_s: float = 1 << 20,
        connect_s: float = 2.0,
        client: FetchClient | None = None,
        forward_stall_s: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.location = self.base_url
        self.kind = kind
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.min_bytes_per_s = min_bytes_per_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if wait_s > 0:
            self._headers[WAIT_HEADER] = f"{wait_s:g}"
        self._read_s = stall_s + wait_s
        # How long a forward may deliver nothing (no less than any other answer).
        self.forward_stall_s = max(forward_stall_s or 0.0, stall_s + wait_s)
        # A client passed in belongs to the caller (shared by many sources); never closed here.
        self._owned = client is None
        self._client = open_client(connect_s) if client is None else client

    def fetch(
        self,
        key: str,
        size: int,
        sink: Callable[[bytes], None] | None = None,
        offset: int = 0,
    ) -> bytes:
        url = f"{self.base_url}/{key}"
        wanted = size - offset
        deadline = time.monotonic() + self.wait_s + self.stall_s + wanted / self.min_bytes_per_s
        headers = self._headers
        if offset:
            headers = {**headers, "Range": f"bytes={offset}-"}
        # What a stall message says of where it stalled: None until the server answers.
        partial: bool | None = None
        received = 0
        try:
            with self._client.get(url, headers, self._read_s) as reply:
                if reply.status == 404:
                    raise FileNotFoundError(f"{self.location} does not hold {key}")
                # A server that ignores the range answers the whole file: its first
                # `offset` bytes are skipped below.
                skip = offset if reply.status == 200 else 0
                if reply.status != 200 and not (offset and reply.status == 206):
                    raise SourceFailed(
                        f"{url} answered {reply.status}; expected 200 with the file",
                        "unavailable" if reply.status in (429, 503) else "error",
                    )
                partial = reply.headers.get(PARTIAL_HEADER.lower()) == "1"
                if partial:
                    reply.set_read_timeout(self.forward_stall_s)
                chunks = []
                for piece in reply.iter_bytes():  # as they arrive: they may be forwarded
                    chunk = piece[skip:]
                    skip -= len(piece) - len(chunk)
                    if not chunk:
                        continue
                    chunks.append(chunk)
                    received += len(chunk)
                    if received > wanted:
                        break  # longer than the origin says: wrong, no need to read on
                    if sink is not None:
                        sink(chunk)
                    # Past the deadline with bytes still to come: too slow. A file that
                    # arrived whole is kept, however late (the caller verifies it anyway).
                    if received < wanted and time.monotonic() > deadline:
                        raise SourceFailed(
                            f"{url} delivered {received} of {wanted} bytes before its deadline",
                            "stall",
                        )
                if partial and received < wanted:
                    raise SourceFailed(
                        f"{url} stopped forwarding {key} after {received} of {wanted} bytes "
                        "(its own source failed)",
                        "unavailable",
                        # The forward ends short when the peer's copy failed its digest
                        # (it forwards before it verifies), so its bytes may be wrong.
                        suspect=True,
                    )
                return b"".join(chunks)
        except UpstreamTimeout as exc:
            where = (
                "before answering"
                if partial is None
                else f"after {received} of {wanted} bytes{' of a forward' if partial else ''}"
            )
            raise SourceFailed(f"{url} stalled {where} ({exc})", "stall") from exc
        except UpstreamError as exc:
            raise SourceFailed(f"{url} failed: {exc}", "error") from exc

    def close(self) -> None:
        if self._owned:
            self._client.close()
