"""Bearer tokens with roles, stored as sha256 hashes.

Owns minting, hashing and checking tokens and the first admin token. A token's plain text
exists only in the reply that mints it (and the one console line of a first start); it is
never logged or stored. Role lookups are cached in memory for at most `cache_s` seconds so
a revoked token stops working within that window on every replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from functools import partial

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from controlplane.errors import ApiError, Forbidden, Unauthorized
from controlplane.models import TokenRow
from controlplane.outage import DATABASE_ERRORS, Outage, is_database_down
from wire import Role

log = logging.getLogger(__name__)

TOKEN_PREFIX = "tth_"

# Who may call which route, one set per audience; both lanes (FastAPI and the hot lane)
# check the same sets.
ANY_ROLE = frozenset(Role)
ADMIN = frozenset({Role.ADMIN})
TRAINER = frozenset({Role.TRAINER})
ENGINE = frozenset({Role.ENGINE})
CALLERS = frozenset({Role.CLIENT, Role.TRAINER})
# The fleet overview: everyone who may look, none who only runs an engine.
READERS = frozenset({Role.VIEWER, Role.CLIENT, Role.TRAINER})


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token_text() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def store_token(sessions: sessionmaker[Session], role: Role, name: str, text: str) -> int:
    with sessions.begin() as db:
        row = TokenRow(
            token_hash=hash_token(text), role=role.value, name=name, created_at=time.time()
        )
        db.add(row)
        db.flush()
        return row.token_id


def mint_token(sessions: sessionmaker[Session], role: Role, name: str = "") -> tuple[int, str]:
    """Create a token for `role`; return its id and its text (shown once)."""
    text = new_token_text()
    return store_token(sessions, role, name, text), text


def ensure_admin_token(sessions: sessionmaker[Session], configured: str | None) -> str | None:
    """On a database without an admin token, create one. Return its text only when it was
    generated here (the caller prints it once); None when configured or already present."""
    with sessions() as db:
        admins = db.scalar(
            select(func.count()).select_from(TokenRow).where(TokenRow.role == "admin")
        )
        if configured:
            known = db.scalar(
                select(TokenRow.token_id).where(TokenRow.token_hash == hash_token(configured))
            )
            if known is None:
                try:
                    store_token(sessions, Role.ADMIN, "TETHER_ADMIN_TOKEN", configured)
                except IntegrityError:
                    # Another replica starting at the same moment stored the same token.
                    log.info("the configured admin token was stored by another replica")
            return None
        if admins:
            return None
    _, text = mint_token(sessions, Role.ADMIN, "first-start")
    log.info("created the first admin token (printed once on the console)")
    return text


class TokenChecker:
    """Resolves `Authorization: Bearer <token>` to a role, with a short in-memory cache."""

    def __init__(self, sessions: sessionmaker[Session], cache_s: float, outage: Outage) -> None:
        self._sessions = sessions
        self._cache_s = cache_s
        self._outage = outage
        # digest → (role, fresh until, learned at); monotonic seconds.
        self._cache: dict[str, tuple[Role | None, float, float]] = {}
        # digest → the one database lookup in progress for it. When an entry expires under
        # load, every request in flight with that token misses at once; they share one
        # lookup instead of each taking a worker thread and a database round trip.
        self._pending: dict[str, asyncio.Future[Role | None]] = {}

    @staticmethod
    def digest(authorization: str | None) -> str:
        """The hash of the bearer token in an Authorization header, or `Unauthorized`."""
        if not authorization:
            raise Unauthorized(
                "missing bearer token: send 'Authorization: Bearer <token>' "
                "(mint one with 'tether token create --role ...')"
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <token>'")
        return hash_token(token.strip())

    def cached(self, digest: str) -> tuple[bool, Role | None]:
        """(hit, role) from the in-memory cache; no database work."""
        entry = self._cache.get(digest)
        if entry is not None and entry[1] > time.monotonic():
            return True, entry[0]
        return False, None

    async def role_of(self, authorization: str | None) -> Role | None:
        """The role of the request's bearer token: from the cache, else from the database
        in a worker thread (at most once per token every `cache_s` seconds)."""
        digest = self.digest(authorization)
        hit, found = self.cached(digest)
        if hit:
            return found
        pending = self._pending.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(digest))
            self._pending[digest] = pending
            pending.add_done_callback(partial(self._settled, digest))
        # Shielded: a caller that goes away does not cancel the lookup the others await.
        return await asyncio.shield(pending)

    async def _fetch(self, digest: str) -> Role | None:
        try:
            return await asyncio.to_thread(self.lookup, digest)
        except DATABASE_ERRORS as exc:
            if not is_database_down(exc):
                raise
            return self._last_known(digest, self._outage.failed(exc, "token check"))

    def _settled(self, digest: str, done: asyncio.Future[Role | None]) -> None:
        self._pending.pop(digest, None)
        if not done.cancelled():
            done.exception()  # retrieved here, so an error nobody awaited any more is not logged

    def _last_known(self, digest: str, unavailable: ApiError) -> Role:
        """While the database is away: the token's last known role, if learned within the
        outage grace; else `unavailable` (a 503), never a guess."""
        entry = self._cache.get(digest)
        if (
            entry is not None
            and entry[0] is not None
            and time.monotonic() - entry[2] < self._outage.stale_view_s
        ):
            return entry[0]
        raise unavailable

    def lookup(self, digest: str) -> Role | None:
        """Read the token's role from the database and cache it briefly."""
        with self._sessions() as db:
            value = db.scalar(select(TokenRow.role).where(TokenRow.token_hash == digest))
        role = Role(value) if value is not None else None
        if len(self._cache) > 10_000:
            self._cache.clear()
        now = time.monotonic()
        self._cache[digest] = (role, now + self._cache_s, now)
        return role

    def owner_key(self, authorization: str | None, role: Role) -> str | None:
        """The credential an engine is bound to: the token's hash. None for an admin
        token, which may act for any engine."""
        return None if role is Role.ADMIN else self.digest(authorization)

    @staticmethod
    def check(role: Role | None, allowed: frozenset[Role]) -> Role:
        if role is None:
            raise Unauthorized("unknown bearer token: check the token or mint a new one")
        if role not in allowed and role is not Role.ADMIN:
            wanted = ", ".join(sorted(r.value for r in allowed | {Role.ADMIN}))
            raise Forbidden(
                f"a {role.value} token may not call this route; it needs one of: {wanted}"
            )
        return role
