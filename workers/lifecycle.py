"""What a worker does at start: test its sandbox once, reap calls whose worker died, sweep workspaces."""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.signals import (celeryd_after_setup, setup_logging, task_postrun, task_prerun, worker_init,
                            worker_process_init,
                            worker_process_shutdown, worker_ready, worker_shutdown, worker_shutting_down)
from prometheus_client import multiprocess

from shared import connections, logs
from shared import metrics as shared_metrics
from shared.errors import SandboxUnavailable
from shared import keys
from shared.placement import Placement, node_queue
from shared.records import Records
from shared.scheduler import Scheduler
from shared.settings import Settings
from workers import metrics, runtime, sandbox
from workers.runtime import WORKER_NAME
from workers.sandbox import BwrapRunner
from workers.sandbox import orphans
from workers.sandbox.keeper import KeeperProcess
from workers.sandbox.prepared import KeeperClient, PreparedRunner, keeper_socket
from workers.tasks import reap_lost_calls
from workers.workspaces import sweep_forever

log = logging.getLogger("runwarden.worker")
HEARTBEAT_S = 2.0  # a worker missing three beats no longer counts in its queues' capacity


def connect_worker_signals(app: Celery, host: runtime.Host) -> None:
    settings = host.settings
    stop = threading.Event()
    pools: list[Pool] = []  # this worker's, once it is ready
    keepers: list[KeeperProcess] = []  # its sandbox keeper, if it has one
    if settings.log_format == "json":
        connect_json_logs(settings)

    @worker_init.connect(weak=False)
    def test_sandbox(**_: object) -> None:
        """Fail closed: a worker whose sandbox cannot start refuses shell calls with the reason."""
        # A worker starts with clean metrics: what the processes of an earlier run counted goes.
        shared_metrics.forget_dead_processes(settings.metrics_dir, counters_too=True)
        host.runner, host.sandbox_error = None, None
        try:
            runner = sandbox.build_runner(settings)
            try:
                sandbox.self_test(runner, settings.workspaces / ".sandbox-selftest")
            finally:
                _release_cgroup(runner)  # the self-test's, made in this main process, which runs no call
        except SandboxUnavailable as exc:
            metrics.sandbox_failed()
            host.sandbox_error = exc.detail
            return
        except Exception as exc:  # whatever broke, shell calls are refused, never run unconfined
            metrics.sandbox_failed()
            host.sandbox_error = f"sandbox setup failed: {type(exc).__name__}: {exc}"
            return
        host.runner = with_keeper(settings, runner, keepers)

    @worker_ready.connect(weak=False)
    def start_reaper(sender: Any, **_: object) -> None:
        # Logged here: worker_init runs before Celery has set up logging.
        if host.runner is None:
            log.error("SANDBOX UNAVAILABLE, shell calls are refused: %s", host.sandbox_error)
        else:
            log.info("sandbox self-test passed (%s)", host.runner.name)
        metrics.start_exporter(settings)
        pool = Pool(sender.hostname, [queue.name for queue in sender.task_consumer.queues],
                    sender.controller.concurrency)
        pools.append(pool)
        threading.Thread(target=_reap_forever, args=(settings, pool, stop), name="runwarden-reaper",
                         daemon=True).start()
        threading.Thread(target=_heartbeat_forever, args=(settings, pool, stop), name="runwarden-heartbeat",
                         daemon=True).start()
        # Idle expiry, measuring and dead workers' staging directories (workers/workspaces.py).
        threading.Thread(target=sweep_forever, args=(settings, WORKER_NAME, stop), name="runwarden-workspaces",
                         daemon=True).start()

    @celeryd_after_setup.connect(weak=False)
    def consume_node_queues(sender: str, instance: Any, **_: object) -> None:
        """A node also consumes the queues of the runs placed on it (contract section 14)."""
        if settings.placement == "node" and settings.node is not None:  # workers/worker.py requires it
            for queue in (keys.FILE_QUEUE, keys.SHELL_QUEUE):
                instance.app.amqp.queues.select_add(node_queue(queue, settings.node))

    @worker_shutting_down.connect(weak=False)
    def take_no_new_call(**_: object) -> None:
        """SIGTERM: the pool leaves its queues' capacity at once (its running calls finish), and a
        node takes no new run."""
        stop.set()
        with suppress(redis.RedisError):
            client = connections.connect(settings, socket_timeout=5)
            for pool in pools:
                for queue in pool.queues:
                    Scheduler(client).leave(queue, pool.name)
            if settings.node is not None:
                Placement(client).drain(settings.node)

    @worker_shutdown.connect(weak=False)
    def stop_reaper(**_: object) -> None:
        stop.set()
        for keeper in keepers:  # the pool has stopped: no call holds a prepared sandbox
            keeper.stop()
        # The pool has stopped: the groups of its processes go, also of those killed outright
        # (a SIGTERM to the whole process group kills pool processes before they can remove theirs).
        cgroups = getattr(host.runner, "cgroups", None)
        if cgroups is not None:
            cgroups.sweep()

    @worker_process_init.connect(weak=False)
    def leave_the_keeper_to_the_main_process(**_: object) -> None:
        for keeper in keepers:
            keeper.in_pool_process()
        if host.runner is not None and host.runner.name == "bwrap":
            orphans.become_subreaper()  # it reaps its sandboxes' inits (workers/sandbox/orphans.py)

    @worker_process_shutdown.connect(weak=False)
    def remove_cgroup(**_: object) -> None:
        """A pool process that ends (replaced, or its worker stopping) takes its cgroup with it;
        one killed outright leaves it to the next worker start's sweep."""
        _release_cgroup(host.runner)
        if settings.metrics_dir is not None:  # its live gauges go with it (its counters stay counted)
            multiprocess.mark_process_dead(os.getpid(), str(settings.metrics_dir))


def with_keeper(settings: Settings, runner: sandbox.Runner, keepers: list[KeeperProcess]) -> sandbox.Runner:
    """The runner the pool uses: bwrap's, with a keeper preparing each run's next sandbox where
    RUNWARDEN_PREPARED_SANDBOXES allows (workers/sandbox/keeper.py); the runner itself otherwise,
    or if the keeper does not start (the pool's calls then all start cold)."""
    if not isinstance(runner, BwrapRunner) or settings.prepared_sandboxes <= 0:
        return runner
    keeper = KeeperProcess(settings, keeper_socket(settings, os.getpid()))
    if not keeper.start():
        return runner
    keeper.supervise()
    keepers.append(keeper)
    return PreparedRunner(runner, KeeperClient(keeper.path))


def connect_json_logs(settings: Settings) -> None:
    """RUNWARDEN_LOG_FORMAT=json: Celery leaves logging to this receiver (it configures nothing
    itself then), and each task's lines carry its call's fields (shared/logs.py)."""

    @setup_logging.connect(weak=False)
    def json_lines(loglevel: Any = None, **_: object) -> None:
        logs.configure(settings, loglevel or logging.INFO)

    @task_prerun.connect(weak=False)
    def bind_call(task_id: str | None = None, args: Any = None, **_: object) -> None:
        logs.reset(**logs.task_fields(args[0] if args else None, task_id))

    @task_postrun.connect(weak=False)
    def unbind_call(**_: object) -> None:
        logs.reset()


def _release_cgroup(runner: object) -> None:
    cgroups = getattr(runner, "cgroups", None)
    if cgroups is not None:
        cgroups.release_own()


@dataclass(frozen=True)
class Pool:
    """What this worker gives the fair scheduler: its name, the queues it consumes, its processes."""

    name: str
    queues: list[str]
    processes: int


def _heartbeat_forever(settings: Settings, pool: Pool, stop: threading.Event) -> None:
    """Say every HEARTBEAT_S that this pool serves its queues (their capacity); each beat also lets
    the scheduler repair what a crash left (shared/scheduler.py, `heal`)."""
    client = connections.connect(settings, socket_timeout=10)
    scheduler, placement = Scheduler(client), Placement(client)
    while True:
        try:
            if settings.node is not None:
                placement.heartbeat(settings.node, settings.node_timeout_s)
            for queue in pool.queues:
                scheduler.heartbeat(queue, pool.name, pool.processes, HEARTBEAT_S * 3)
        except redis.RedisError as exc:
            log.warning("heartbeat cannot reach Redis: %s", exc)
        if stop.wait(HEARTBEAT_S):
            return


def _reap_forever(settings: Settings, pool: Pool, stop: threading.Event) -> None:
    client = connections.connect(settings, socket_timeout=10)
    records = Records(client, ttl_s=settings.idempotency_ttl_s, retention_s=settings.stream_retention_s,
                      lease_s=settings.lease_s)
    while not stop.wait(settings.lease_s / 2):
        try:
            if reaped := reap_lost_calls(records, settings.lease_s):
                log.warning("marked %d shell call(s) lost: their worker stopped renewing its lease", reaped)
            if unsent := records.lose_unsent_calls(pool.queues):
                log.warning("marked %d queued call(s) lost: a broker restart lost their messages", unsent)
        except redis.RedisError as exc:
            log.warning("reaper cannot reach Redis: %s", exc)
            time.sleep(1)
