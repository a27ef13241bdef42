"""`celery -A bench.floor_worker worker`: the product's Celery configuration plus one task that only
spawns the same sandbox as a shell call (`bwrap … true`) and waits for it. It is the floor of shell
throughput, run on its own prefork pool with the same concurrency as the product worker.
"""
from __future__ import annotations

import os
from pathlib import Path

from bench import floor_sandbox
from bench.names import SANDBOX_TASK
from shared.settings import Settings
from workers.celery_app import create_celery

settings = Settings.from_env()
celery = create_celery(settings)
_root = os.environ.get("BENCH_FLOOR_ROOT")
# Built once in the main process, before the pool forks, like the product worker's runner.
_runner, _workspace = floor_sandbox.build(settings, Path(_root)) if _root else (None, None)


@celery.task(name=SANDBOX_TASK)
def sandbox_true() -> int:
    assert _runner is not None and _workspace is not None, "BENCH_FLOOR_ROOT is not set"
    return floor_sandbox.spawn_true(_runner, _workspace)
