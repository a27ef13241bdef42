"""Revoked token ids (contract section 10): a request with one is a 401, and a stream opened with
one is closed within two seconds (4401).

A revocation is a key per jti (`runwarden token revoke`: any tenant's; `POST /v1/admin/revocations`:
the admin's own tenant only), checked in the claim's round trip and by every authenticated request,
plus an entry in one sorted set that each API process polls (`Watcher`), so its open streams learn
of it without a Redis command per stream.
"""
from __future__ import annotations

import threading
import time

import redis

from shared import keys

POLL_S = 0.5


def revoke(client: redis.Redis, jti: str, ttl_s: int, tenant: str | None = None) -> None:
    """Revoke `jti` for `ttl_s` (at least the longest a token may live): of `tenant`'s tokens
    only, or of every tenant's when None."""
    now = time.time()
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.revoked_jti(jti, tenant), "1", ex=ttl_s)
    pipe.zadd(keys.REVOCATIONS, {watch_entry(jti, tenant): now + ttl_s})
    pipe.zremrangebyscore(keys.REVOCATIONS, 0, now)
    pipe.execute()


def watch_entry(jti: str, tenant: str | None) -> str:
    return jti if tenant is None else f"{tenant}\0{jti}"


def is_revoked(client: redis.Redis, jti: str, tenant: str) -> bool:
    return bool(client.exists(keys.revoked_jti(jti), keys.revoked_jti(jti, tenant)))


class Watcher:
    """This process's copy of the live revocations, refreshed every POLL_S by one thread."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.entries: frozenset[str] = frozenset()
        self._started = threading.Lock()
        self._thread: threading.Thread | None = None

    def revoked(self, jti: str, tenant: str) -> bool:
        self.start()
        return jti in self.entries or watch_entry(jti, tenant) in self.entries

    def start(self) -> None:
        """Read the revocations now and keep them fresh from then on (once; idempotent)."""
        if self._thread is None:
            with self._started:
                if self._thread is None:
                    self._refresh()
                    self._thread = threading.Thread(target=self._poll, name="runwarden-revocations", daemon=True)
                    self._thread.start()

    def _refresh(self) -> None:
        found = self.client.zrangebyscore(keys.REVOCATIONS, time.time(), "+inf")
        self.entries = frozenset(entry.decode() for entry in found)

    def _poll(self) -> None:
        while True:
            time.sleep(POLL_S)
            try:
                self._refresh()
            except redis.RedisError:
                pass  # the streams themselves end on the same outage
