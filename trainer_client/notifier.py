"""Telling the control plane about new versions, without ever losing one.

Owns the trainer's side of `POST /v1/runs/{run}/versions`: a version whose pointer has moved
is queued, sent in order, and kept queued when the control plane is unreachable or answers
with a server error, so the next `flush` sends it again. A failed notification only delays
engines (they also follow the store pointer); it never undoes or loses a publish. This module
never touches the store and never raises from `flush`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import httpx

from store.types import VersionKind

log = logging.getLogger(__name__)


class ControlPlaneRefused(RuntimeError):
    """The control plane rejected a request as invalid (4xx other than a retryable one).

    Recovery: fix the request (token, run id, version); retrying the same one will not help.
    """


@dataclass(frozen=True)
class PendingVersion:
    version: int
    kind: VersionKind


def auth_headers(token: str | None) -> dict[str, str]:
    """The bearer header for a Tether token (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def error_text(response: httpx.Response) -> str:
    """The control plane's error message if the body has the Tether error shape, else text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        return f"{error.get('type', 'error')}: {error.get('message', '')}"
    return response.text[:500]


class VersionNotifier:
    """Queues version notifications for one run and delivers them in order."""

    def __init__(self, client: httpx.Client, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.pending: list[PendingVersion] = []
        self.failures = 0
        self.last_error: str | None = None
        # Whether the last failure may pass by itself (unreachable, 5xx, 429), unlike a 4xx.
        self.transient = False
        # `flush` from two threads (a publish still running while the trainer closes)
        # would send a version twice and pop it twice.
        self._lock = threading.Lock()

    def notify(self, version: int, kind: VersionKind) -> bool:
        """Queue `version` and try to deliver everything queued; True if nothing is left."""
        with self._lock:
            self.pending.append(PendingVersion(version, kind))
        return self.flush()

    def flush(self) -> bool:
        """Deliver queued notifications, oldest first; True if the queue is empty after.

        Stops at the first failure and keeps the rest for the next call. A transient one
        (connection error, 5xx, 429) is a warning; a refusal (4xx: a bad token, an unknown
        run) is logged as an error with the control plane's message, and `last_error` keeps
        it. Never raises: a publish that moved the pointer has succeeded either way.
        """
        with self._lock:
            return self._flush()

    def _flush(self) -> bool:
        while self.pending:
            item = self.pending[0]
            path = f"/v1/runs/{self.run_id}/versions"
            try:
                response = self.client.post(
                    path, json={"version": item.version, "kind": item.kind.value}
                )
            except httpx.HTTPError as exc:
                self._keep(item, f"could not reach the control plane: {exc}")
                return False
            if response.status_code >= 500 or response.status_code == 429:
                self._keep(item, f"control plane answered {response.status_code}")
                return False
            if response.status_code >= 400:
                self.failures += 1
                self.transient = False
                self.last_error = (
                    f"the control plane refused the notification of {self.run_id} "
                    f"v{item.version} with {response.status_code} ({error_text(response)}); "
                    "check the token's role (trainer) and that the run exists there"
                )
                log.error("%s", self.last_error)
                return False
            self.pending.pop(0)
            self.last_error = None
            log.info("notified the control plane of run %s v%d", self.run_id, item.version)
        return True

    def deliver(self, within_s: float, first_wait_s: float = 0.2, max_wait_s: float = 5.0) -> bool:
        """`flush` until the queue is empty, a refusal, or `within_s` seconds have passed,
        waiting with exponential backoff between tries; True if everything was delivered."""
        deadline = time.monotonic() + within_s
        wait = first_wait_s
        while not self.flush():
            left = deadline - time.monotonic()
            if not self.transient or left <= 0:
                log.warning(
                    "%d notification(s) of run %s undelivered (%s); the control plane adopts "
                    "the store's pointer by itself",
                    len(self.pending),
                    self.run_id,
                    self.last_error,
                )
                return False
            time.sleep(min(wait, left))  # backoff between delivery attempts
            wait = min(wait * 2, max_wait_s)
        return True

    def _keep(self, item: PendingVersion, why: str) -> None:
        self.failures += 1
        self.transient = True
        self.last_error = why
        log.warning(
            "notification of run %s v%d delayed (%s); the version is published and will be "
            "announced on the next publish or flush",
            self.run_id,
            item.version,
            why,
        )
