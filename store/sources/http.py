"""`HttpSource`: version files over plain HTTP GET, from a peer agent or a distributor.

`GET {base_url}/{key}` must answer the object's bytes (200), or 404 when the server does
not hold it. That is what a peer agent's file route speaks, and what an HTTP cache in front
of the bucket, a Dragonfly or Kraken proxy, or any static file server offers. A bearer
token is sent when given (peers require the engine role). Never verifies bytes (the caller
does) and never logs the token.

Deadlines: a server may hold a request while it fetches the file itself (a peer still
catching up; the wait it may take is sent in `WAIT_HEADER`). After that, a transfer that
delivers nothing for `stall_s`, or that runs slower than `min_bytes_per_s` overall, is a
stall: `SourceFailed("stall")`, and the caller moves on.
"""

from __future__ import annotations

import time

import httpx

from store.sources.base import FetchSource, SourceFailed

# How long (seconds) the server may hold the request for a file it is still fetching.
WAIT_HEADER = "X-Tether-Peer-Wait"
_CHUNK = 1 << 20


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
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.location = self.base_url
        self.kind = kind
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.min_bytes_per_s = min_bytes_per_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if wait_s > 0:
            headers[WAIT_HEADER] = f"{wait_s:g}"
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(stall_s + wait_s, connect=connect_s),
        )

    def fetch(self, key: str, size: int) -> bytes:
        url = f"{self.base_url}/{key}"
        deadline = time.monotonic() + self.wait_s + self.stall_s + size / self.min_bytes_per_s
        try:
            with self._client.stream("GET", url) as reply:
                if reply.status_code == 404:
                    raise FileNotFoundError(f"{self.location} does not hold {key}")
                if reply.status_code != 200:
                    raise SourceFailed(
                        f"{url} answered {reply.status_code}; expected 200 with the file",
                        "unavailable" if reply.status_code in (429, 503) else "error",
                    )
                chunks = []
                received = 0
                for chunk in reply.iter_bytes(_CHUNK):
                    chunks.append(chunk)
                    received += len(chunk)
                    if received > size:
                        break  # longer than the origin says: wrong, no need to read on
                    if time.monotonic() > deadline:
                        raise SourceFailed(
                            f"{url} delivered {received} of {size} bytes before its deadline",
                            "stall",
                        )
                return b"".join(chunks)
        except httpx.TimeoutException as exc:
            raise SourceFailed(f"{url} stalled ({type(exc).__name__})", "stall") from exc
        except httpx.HTTPError as exc:
            raise SourceFailed(f"{url} failed: {type(exc).__name__}: {exc}", "error") from exc

    def close(self) -> None:
        self._client.close()
