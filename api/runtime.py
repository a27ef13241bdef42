"""What the API process holds: built once by the app factory, found through `current_app`."""
from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery
from flask import current_app

from api.streams import StreamServer
from shared import connections
from shared.idempotency import Idempotency, Releases
from shared.placement import Placement
from shared.records import Records
from shared.revocations import Watcher
from shared.scheduler import Scheduler
from shared.settings import Settings
from shared.tenants import Quotas


@dataclass
class Runtime:
    settings: Settings
    redis: redis.Redis
    celery: Celery
    idempotency: Idempotency
    releases: Releases
    records: Records
    scheduler: Scheduler
    revocations: Watcher
    placement: Placement
    streams: StreamServer

    @classmethod
    def build(cls, settings: Settings, celery: Celery) -> "Runtime":
        # Each waiting POST (and MCP progress stream) holds a connection in BLPOP or XREAD BLOCK: the
        # pool must be larger than the server's thread count (redis-py's default cap is 100).
        # WebSocket streams take none of these: the stream server reads for all of them at once.
        client = connections.connect(settings, socket_connect_timeout=2, socket_timeout=10,
                                     health_check_interval=30, retry_on_timeout=False, max_connections=2048)
        idempotency = Idempotency(client, settings.idempotency_ttl_s, settings.rate_limit_per_s,
                                  Quotas.defaults(settings), settings.placement == "node")
        records = Records(client, ttl_s=settings.idempotency_ttl_s, retention_s=settings.stream_retention_s,
                          lease_s=settings.lease_s)
        revocations = Watcher(client)
        return cls(
            settings=settings,
            redis=client,
            celery=celery,
            idempotency=idempotency,
            releases=Releases(idempotency),
            records=records,
            scheduler=Scheduler(client),
            revocations=revocations,
            placement=Placement(client),
            streams=StreamServer(settings, records, revocations),
        )


def runtime() -> Runtime:
    return current_app.extensions["runwarden"]
