"""The bare floors' app and tasks: Flask and Celery with nothing of runwarden in them.

- `create_app()`, served by gunicorn's stock `gthread` worker class (the product's
  `api.server.Worker` is runwarden's to justify, so it is not floor): `POST /noop` sends the no-op
  task and waits for its result through Celery's result backend; `POST /sandbox` sends the task
  that only spawns the bare sandbox, and waits with BLPOP on a key the task pushes (Celery's result
  consumer cannot be shared by the server's threads: BlockingIOError under 32 concurrent waits).
- `celery -A bench.bare worker --pool prefork --concurrency 2`: the same app's two tasks.

The Celery app is Celery's default configuration on the product's Redis, as broker and result
backend: JSON serializer, no task events, no sent events, no transport options, the default queue
(`celery`, which no other worker of the bench consumes).
"""
from __future__ import annotations

import os
import uuid

import redis
from celery import Celery
from flask import Flask, Response, request

from bench.floor_sandbox import BARE_BWRAP_ENV, bare_bwrap_true
from bench.names import BARE_NOOP_TASK as NOOP_TASK, BARE_SANDBOX_TASK as SANDBOX_TASK
from shared.settings import Settings

_settings = Settings.from_env(require_jwt=False)
celery = Celery("bare", broker=_settings.redis_url, backend=_settings.redis_url)
_redis: tuple[int, redis.Redis] | None = None


def _client() -> redis.Redis:
    """One client per process (the worker's pool forks after import)."""
    global _redis
    if _redis is None or _redis[0] != os.getpid():
        _redis = (os.getpid(), redis.Redis.from_url(_settings.redis_url))
    return _redis[1]


@celery.task(name=NOOP_TASK)
def noop() -> str:
    return "pong"


@celery.task(name=SANDBOX_TASK, ignore_result=True)
def sandbox_true(done_key: str) -> None:
    code = bare_bwrap_true(os.environ[BARE_BWRAP_ENV])
    pipe = _client().pipeline(transaction=False)
    pipe.rpush(done_key, code)
    pipe.expire(done_key, 60)
    pipe.execute()


def create_app() -> Flask:
    app = Flask("bench-bare")

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok", content_type="text/plain")

    @app.post("/noop")
    def send_noop() -> Response:
        request.get_data()
        value = celery.send_task(NOOP_TASK).get(timeout=30)
        return Response(f'{{"result":"{value}"}}', content_type="application/json")

    @app.post("/sandbox")
    def send_sandbox() -> Response:
        request.get_data()
        done_key = f"bench:bare-done:{uuid.uuid4().hex}"
        celery.send_task(SANDBOX_TASK, args=[done_key])
        found = _client().blpop([done_key], timeout=60)
        if found is None:
            return Response("timeout", status=504)
        return Response(f'{{"exit_code":{int(found[1])}}}', content_type="application/json")

    return app
