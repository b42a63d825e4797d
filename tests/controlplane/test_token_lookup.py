"""A token whose cached role expired is looked up once, however many requests carry it at
that moment: they share one database read (under load, every request in flight misses at
the same instant). A revoked or unknown token is still refused, and a lookup that fails
fails every request that shared it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from controlplane import db as dbmod
from controlplane.auth import TokenChecker, mint_token
from controlplane.models import TokenRow
from controlplane.outage import Outage
from controlplane.registry import Registry
from wire import Role


class CountingChecker(TokenChecker):
    """The real checker on a real database, counting its database reads."""

    lookups = 0

    def lookup(self, digest: str) -> Role | None:
        self.lookups += 1
        return super().lookup(digest)


def checker(tmp_path: Path, cache_s: float) -> tuple[CountingChecker, str, sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    dbmod.migrate(url)
    engine = dbmod.open_engine(url)
    sessions = dbmod.session_factory(engine)
    outage = Outage(Registry(sessions, 10.0), 1.0, 60.0)
    _, token = mint_token(sessions, Role.CLIENT, "load")
    return CountingChecker(sessions, cache_s, outage), f"Bearer {token}", sessions


def test_concurrent_requests_with_an_expired_token_share_one_lookup(tmp_path: Path) -> None:
    tokens, header, _ = checker(tmp_path, cache_s=0.0)  # every entry is expired at once

    async def burst() -> list[Role | None]:
        return await asyncio.gather(*(tokens.role_of(header) for _ in range(50)))

    roles = asyncio.run(burst())
    assert roles == [Role.CLIENT] * 50
    assert tokens.lookups == 1
    asyncio.run(burst())  # a later burst reads the database again: nothing is kept longer
    assert tokens.lookups == 2


def test_a_revoked_token_is_refused_on_the_next_lookup(tmp_path: Path) -> None:
    tokens, header, sessions = checker(tmp_path, cache_s=0.0)
    assert asyncio.run(tokens.role_of(header)) is Role.CLIENT
    with sessions.begin() as db:
        db.execute(delete(TokenRow))
    assert asyncio.run(tokens.role_of(header)) is None


def test_a_failed_shared_lookup_fails_every_request_that_waited_for_it(tmp_path: Path) -> None:
    tokens, header, _ = checker(tmp_path, cache_s=0.0)

    class Broken(CountingChecker):
        def lookup(self, digest: str) -> Role | None:
            self.lookups += 1
            raise RuntimeError("the lookup broke")

    broken = Broken(tokens._sessions, 0.0, tokens._outage)

    async def burst() -> list[object]:
        return await asyncio.gather(*(broken.role_of(header) for _ in range(5)),
                                    return_exceptions=True)  # fmt: skip

    failures = asyncio.run(burst())
    assert broken.lookups == 1
    assert all(isinstance(f, RuntimeError) for f in failures)
    with pytest.raises(RuntimeError):
        asyncio.run(broken.role_of(header))  # the failure is not remembered as a role
    assert broken.lookups == 2
