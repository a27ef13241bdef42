"""`celery -A bench.floor_worker worker`: the product's Celery configuration plus one task that only
spawns the same sandbox as a shell call (`bwrap … true`) and waits for it. It is the floor of shell
throughput, run on its own prefork pool with the same concurrency as the product worker.
"""
from __future__ import annotations

import os
from pathlib import Path

import redis

from bench import floor_sandbox
from bench.names import SANDBOX_TASK
from shared.settings import Settings
from shared.celery_app import create_celery

settings = Settings.from_env()
celery = create_celery(settings)
_root = os.environ.get("BENCH_FLOOR_ROOT")
# Built once in the main process, before the pool forks, like the product worker's runner.
_floor = floor_sandbox.build(settings, Path(_root)) if _root else None


_redis = None


@celery.task(name=SANDBOX_TASK, ignore_result=True)
def sandbox_true(done_key: str) -> None:
    """Spawn the sandbox; report like runwarden's tasks do (a push the API BLPOPs), since Celery's
    result consumer cannot be shared by the server's threads."""
    global _redis
    assert _floor is not None, "BENCH_FLOOR_ROOT is not set"
    code = floor_sandbox.spawn_true(_floor)
    if _redis is None or _redis[0] != os.getpid():
        _redis = (os.getpid(), redis.Redis.from_url(settings.redis_url))
    pipe = _redis[1].pipeline(transaction=False)
    pipe.rpush(done_key, code)
    pipe.expire(done_key, 60)
    pipe.execute()
