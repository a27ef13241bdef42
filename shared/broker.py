"""Celery's broker transport: kombu's Redis (or Sentinel) transport, with two repairs for a Redis
that dies under load, and one client per channel for its commands.

When Redis goes away, Celery's consumer closes its broker connection, and closing its channel gives
back the messages it had received but not acked (`restore_unacked`): the calls its worker had
reserved, and the file calls it was running (acked late).

- That close built a client from a connection kombu had already let go of and raised
  `AttributeError: 'NoneType' object has no attribute 'hostname'` (kombu's `_connparams`), which
  Celery takes as unrecoverable: the worker stopped and nothing consumed until it was started
  again (celery/kombu#582, celery/celery#10205). Here it is what it is, a connection error, which
  the close ignores as it ignores any other.
- Redis being down, the messages could not be given back then, and stayed in kombu's unacked set
  until the visibility timeout (an hour by default) returned them: their calls' keys answered 409
  meanwhile. Here they are remembered, and given back by the worker's next channel, once it has
  connected again. Running a call's message twice is safe by design (a call starts once; a file
  call's intent makes its write happen once): this only makes it come back sooner.

kombu builds a new redis-py client for each command it sends outside its event loop: every
publish (the API's send_task) and each delivered message's unacked record and its ack. With
redis-py 5 and later a client costs ~0.14 ms of CPU to build, three times a shell call. Here a
channel keeps one, on the same connection pool, for as long as that pool is the channel's.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from shared.connections import parse_sentinels

log = logging.getLogger("runwarden.broker")

# Delivery tags of messages this process received and could not give back while Redis was down.
_to_give_back: set[str] = set()


class QoS(kombu_redis.QoS):
    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except RedisError:
            _to_give_back.update(self._delivered)  # still in Redis's unacked set: restored later
            self._delivered.clear()
            raise


class _Repaired:
    """The repairs, for kombu's Redis channel and its Sentinel one alike (first in their bases)."""

    QoS = QoS
    connection: Any
    qos: Any
    pool: Any
    _client_for: tuple[Any, Any] | None = None  # (the pool, a client on it)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _to_give_back:
            self.give_back_unacked()

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """The client given, or the channel's own for its pool (kombu's builds one each time)."""
        if client:
            yield client
            return
        pool = self.pool
        if self._client_for is None or self._client_for[0] is not pool:
            self._client_for = (pool, self._create_client())  # type: ignore[attr-defined]
        yield self._client_for[1]

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise RedisConnectionError("the broker connection is closed")
        return super()._connparams(asynchronous)  # type: ignore[misc, no-any-return]

    def give_back_unacked(self) -> int:
        """Give back what an earlier channel of this process could not (see the module's doc)."""
        given = 0
        for tag in sorted(_to_give_back):
            try:
                self.qos.restore_by_tag(tag)  # at the head of its queue, as kombu gives back its own
            except RedisError:
                break  # Redis is away again: the next channel tries
            _to_give_back.discard(tag)
            given += 1
        if given:
            log.warning("gave back %d message(s) held when the broker connection was lost", given)
        return given


class Channel(_Repaired, kombu_redis.Channel):
    pass


class SentinelChannel(_Repaired, kombu_redis.SentinelChannel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def transport_for(redis_url: str) -> str:
    """The transport Celery is given for this URL (a `sentinel://` list or a plain Redis URL)."""
    kind = "SentinelTransport" if parse_sentinels(redis_url) is not None else "Transport"
    return f"{__name__}:{kind}"
