"""The Celery application factory, used by the workers and (to send tasks by name) by the API.

Delivery semantics, chosen deliberately (see README, "Delivery semantics"):
- file tasks: acks_late + reject_on_worker_lost, so a killed worker's patch is delivered again; the
  worker-side intent record makes the write happen once (exactly-once effect); attempts are counted;
- shell tasks: acked on receipt (at-most-once) and guarded by the queued→running transition, so a
  redelivered message never runs a command twice; a call whose worker dies becomes `lost`.
"""
from __future__ import annotations

from celery import Celery

from shared import keys
from shared.broker import transport_for
from shared.connections import celery_transport_options
from shared.schema import TOOLS
from shared.settings import Settings

PING_TASK = "runwarden.ping"


def create_celery(settings: Settings) -> Celery:
    app = Celery("runwarden", broker=settings.redis_url, backend=settings.redis_url)
    # A `sentinel://…;…` URL is read by kombu and Celery's Sentinel backend, given the master's name here.
    transport = {"visibility_timeout": settings.visibility_timeout_s, **celery_transport_options(settings)}
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_default_queue=keys.FILE_QUEUE,
        task_routes={
            **{tool.task_name: {"queue": tool.queue} for tool in TOOLS.values()},
            PING_TASK: {"queue": keys.FILE_QUEUE},
        },
        task_create_missing_queues=True,
        worker_prefetch_multiplier=1,
        # A backstop: pool children stay flat in the bench's soak, but one that grows is recycled.
        worker_max_memory_per_child=256 * 1024,
        broker_transport=transport_for(settings.redis_url),  # kombu's, repaired: shared/broker.py
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        result_expires=3600,  # runwarden keeps its own record of every outcome for 24 h
        # Off unless asked for: Flower turns them on by itself (its `enable_events`, every 5 s), and
        # while no monitor listens each call's three events cost the worker's main process ~1 ms
        # of CPU (docs/PERFORMANCE.md). Worker heartbeats are sent either way.
        worker_send_task_events=settings.task_events,
        # No task-sent event from the API: it doubled what a send publishes (0.46 → 0.27 ms of CPU
        # and 0.61 → 0.33 ms a send, measured with redis-py 8.1 and kombu 5.7). Flower sees a call
        # from its task-received on; a queued call is in runwarden's own record and queue metrics.
        task_send_sent_event=False,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        redis_socket_timeout=30,
        redis_socket_connect_timeout=3,
        redis_retry_on_timeout=True,
        task_ignore_result=False,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app
