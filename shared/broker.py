"""Celery's broker transport: kombu's Redis (or Sentinel) transport, with one repair.

When Redis dies under load, Celery's consumer closes its broker connection, and closing a channel
gives back the messages it had received but not acked (`restore_unacked`) through a client built
from a connection kombu has already let go of. That raised `AttributeError: 'NoneType' object has
no attribute 'hostname'` (kombu's `_connparams`), which Celery takes as unrecoverable: the worker
stopped, and nothing consumed until it was started again (celery/kombu#582, celery/celery#10205).
Here that case is what it is, a connection error, which the close ignores as it ignores any other;
the messages stay in kombu's unacked set and come back after the visibility timeout, as they do
when a worker is killed.
"""
from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.connections import parse_sentinels


class _ClosedIsAConnectionError:
    connection: Any

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise RedisConnectionError("the broker connection is closed")
        return super()._connparams(asynchronous)  # type: ignore[misc, no-any-return]


class Channel(_ClosedIsAConnectionError, kombu_redis.Channel):
    pass


class SentinelChannel(_ClosedIsAConnectionError, kombu_redis.SentinelChannel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def transport_for(redis_url: str) -> str:
    """The transport Celery is given for this URL (a `sentinel://` list or a plain Redis URL)."""
    kind = "SentinelTransport" if parse_sentinels(redis_url) is not None else "Transport"
    return f"{__name__}:{kind}"
