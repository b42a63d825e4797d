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

Clients: opening an `httpx.Client` loads the CA bundle into a new TLS context (0.1–0.3 s of
CPU, holding the GIL), so every source shares one process-wide TLS context, and an agent
passes one client to all the peers of all its passes (`client=`): a fleet's catch-ups start
together, and building clients per peer per pass stalled the event loop of a swarm for
seconds.
"""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Callable

import httpx

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


def open_client(connect_s: float = 2.0) -> httpx.Client:
    """A client for fetch sources: cheap to open (the shared TLS context), no default headers
    (each request carries its own)."""
    return httpx.Client(verify=shared_tls(), timeout=httpx.Timeout(30.0, connect=connect_s))


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
        client: httpx.Client | None = None,
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
        self._timeout = httpx.Timeout(stall_s + wait_s, connect=connect_s)
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
            with self._client.stream("GET", url, headers=headers, timeout=self._timeout) as reply:
                if reply.status_code == 404:
                    raise FileNotFoundError(f"{self.location} does not hold {key}")
                # A server that ignores the range answers the whole file: its first
                # `offset` bytes are skipped below.
                skip = offset if reply.status_code == 200 else 0
                if reply.status_code != 200 and not (offset and reply.status_code == 206):
                    raise SourceFailed(
                        f"{url} answered {reply.status_code}; expected 200 with the file",
                        "unavailable" if reply.status_code in (429, 503) else "error",
                    )
                partial = reply.headers.get(PARTIAL_HEADER) == "1"
                if partial:
                    _patient_body(reply, self.forward_stall_s)
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
        except httpx.TimeoutException as exc:
            where = (
                "before answering"
                if partial is None
                else f"after {received} of {wanted} bytes{' of a forward' if partial else ''}"
            )
            raise SourceFailed(f"{url} stalled {where} ({type(exc).__name__})", "stall") from exc
        except httpx.HTTPError as exc:
            raise SourceFailed(f"{url} failed: {type(exc).__name__}: {exc}", "error") from exc

    def close(self) -> None:
        if self._owned:
            self._client.close()


def _patient_body(reply: httpx.Response, read_s: float) -> None:
    """Let the body of `reply` (not read yet) be silent for `read_s` between bytes. httpcore
    takes the read timeout of a body from the request's `timeout` extension when the body
    is first read, so one set here holds for this body alone."""
    timeouts = reply.request.extensions.get("timeout")
    if isinstance(timeouts, dict):
        reply.request.extensions["timeout"] = {**timeouts, "read": read_s}
