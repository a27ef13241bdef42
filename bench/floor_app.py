"""The floor HTTP app, served by gunicorn with exactly the product API's settings.

- `POST /ping`: `send_task('runwarden.ping').get()` through the product's broker and worker pool;
- `POST /sandbox`: `send_task('bench.sandbox_true')` on the floor worker (a task that only spawns the sandbox),
  waiting with BLPOP on a key the task pushes to — runwarden's own way of waiting, because Celery's
  result consumer is not safe to share between the server's threads (BlockingIOError under load);
- `WS /pubsub/<channel>`: Redis pub/sub → flask-sock → WebSocket, one text frame per message,
  written the way the product's stream handler writes (wsproto frame, `sendall`).
"""
from __future__ import annotations

import uuid

import redis
from flask import Flask, Response, request
from flask_sock import Sock
from wsproto.events import TextMessage

from bench.names import END, FLOOR_QUEUE, SANDBOX_TASK, channel
from shared.settings import Settings
from shared.celery_app import PING_TASK, create_celery

def create_app() -> Flask:
    settings = Settings.from_env()
    celery = create_celery(settings)
    client = redis.Redis.from_url(settings.redis_url)
    app = Flask("bench-floor")
    sock = Sock(app)

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok", content_type="text/plain")

    @app.post("/ping")
    def ping() -> Response:
        request.get_data()
        value = celery.send_task(PING_TASK).get(timeout=30)
        return Response(f'{{"result":"{value}"}}', content_type="application/json")

    @app.post("/sandbox")
    def sandbox() -> Response:
        request.get_data()
        done_key = f"bench:done:{uuid.uuid4().hex}"
        celery.send_task(SANDBOX_TASK, args=[done_key], queue=FLOOR_QUEUE)
        found = client.blpop([done_key], timeout=60)
        if found is None:
            return Response("timeout", status=504)
        return Response(f'{{"exit_code":{int(found[1])}}}', content_type="application/json")

    @sock.route("/pubsub/<name>")
    def pubsub(ws, name: str) -> None:  # type: ignore[no-untyped-def]
        subscriber = client.pubsub()
        subscriber.subscribe(channel(name))
        try:
            while (message := subscriber.get_message(timeout=10)) is not None and message["type"] != "subscribe":
                pass
            ws.send("ready")  # the subscription is active: the publisher may start
            for message in subscriber.listen():
                if message["type"] != "message":
                    continue
                if message["data"] == END:
                    break
                ws.sock.sendall(ws.ws.send(TextMessage(data=message["data"].decode())))
        finally:
            subscriber.close()
        ws.close(1000)

    return app
