"""Every Redis client of runwarden, and Celery's broker and backend, built from the settings here.

`RUNWARDEN_REDIS_URL` is what redis-py's `from_url` takes (`redis://`, `rediss://`, `unix://`), or a
list of Redis Sentinels written as Celery and kombu write it:

    sentinel://[:PASSWORD@]HOST[:PORT][/DB];sentinel://[:PASSWORD@]HOST[:PORT][/DB];…

with the monitored master's name in `RUNWARDEN_REDIS_SENTINEL_MASTER` (default `mymaster`). The
password is the master's (the first entry's is used, as kombu does); Sentinels that require one of
their own get `RUNWARDEN_REDIS_SENTINEL_PASSWORD`. Every client then asks a Sentinel where the master
is, and asks again after a failover (redis-py's `SentinelConnectionPool`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

if TYPE_CHECKING:
    from shared.settings import Settings

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379
# Every client fails fast when Redis is away, so the API answers 503 instead of hanging; callers
# add a `socket_timeout` above their longest blocking command.
CONNECT_TIMEOUT_S = 3
SENTINEL_TIMEOUT_S = 2


@dataclass(frozen=True)
class Sentinels:
    """A Sentinel URL list, parsed: where the Sentinels are, and how to log in to the master."""

    addresses: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None


def parse_sentinels(url: str) -> Sentinels | None:
    """The Sentinels a `sentinel://…;sentinel://…` URL names; None for any other URL. Raises
    ValueError (without echoing the URL, which may hold a password) when it is malformed."""
    if not url.startswith(f"{SENTINEL_SCHEME}://"):
        return None
    entries = [entry for entry in url.split(";") if entry.strip()]
    addresses, first = [], urlsplit(entries[0])
    for entry in entries:
        parts = urlsplit(entry.strip())
        try:
            port = parts.port or SENTINEL_PORT
        except ValueError:
            raise ValueError("a Sentinel's port is not a number in range") from None
        if parts.scheme != SENTINEL_SCHEME or not parts.hostname or parts.query or parts.fragment:
            raise ValueError("every entry must be sentinel://[:password@]host[:port][/db], separated by ';'")
        addresses.append((parts.hostname, port))
    db_text = first.path.strip("/") or "0"
    if not db_text.isdigit():
        raise ValueError("the database of a Sentinel URL must be a number")
    return Sentinels(tuple(addresses), int(db_text), unquote(first.username) if first.username else None,
                     unquote(first.password) if first.password else None)


def connect(settings: Settings, **options: Any) -> redis.Redis:
    """A client of runwarden's Redis (through its Sentinels when the URL lists them). `options` are
    redis-py's connection options (`socket_timeout`, `client_name`, `max_connections`…)."""
    options = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_keepalive": True, **options}
    sentinels = parse_sentinels(settings.redis_url)
    if sentinels is None:
        return redis.Redis.from_url(settings.redis_url, **options)
    credentials = {"username": sentinels.username, "password": sentinels.password, "db": sentinels.db}
    sentinel = Sentinel(list(sentinels.addresses), sentinel_kwargs=_sentinel_kwargs(settings))
    return sentinel.master_for(settings.redis_sentinel_master, redis_class=redis.Redis, **credentials, **options)


def connect_async(settings: Settings, *, single_connection: bool = False, **options: Any) -> aredis.Redis:
    """The asyncio client of the same Redis, for the stream server (api/fanout.py). With
    `single_connection`, one connection of its own for a plain URL (a reader's XREAD BLOCK); behind
    Sentinels, a pool that the reader's one command at a time keeps to one connection."""
    options = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_keepalive": True, **options}
    sentinels = parse_sentinels(settings.redis_url)
    if sentinels is None:
        return aredis.Redis.from_url(settings.redis_url, single_connection_client=single_connection, **options)
    credentials = {"username": sentinels.username, "password": sentinels.password, "db": sentinels.db}
    sentinel = AsyncSentinel(list(sentinels.addresses), sentinel_kwargs=_sentinel_kwargs(settings))
    return sentinel.master_for(settings.redis_sentinel_master, redis_class=aredis.Redis, **credentials, **options)


def _sentinel_kwargs(settings: Settings) -> dict[str, Any]:
    """How to talk to the Sentinels themselves (not the master)."""
    kwargs: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    if settings.redis_sentinel_password:
        kwargs["password"] = settings.redis_sentinel_password
    return kwargs


def celery_transport_options(settings: Settings) -> dict[str, Any]:
    """What kombu's broker and Celery's result backend need besides the URL: for Sentinels, the
    master's name and how to reach them (both read `sentinel://` URLs themselves)."""
    if parse_sentinels(settings.redis_url) is None:
        return {}
    return {"master_name": settings.redis_sentinel_master, "sentinel_kwargs": _sentinel_kwargs(settings)}
