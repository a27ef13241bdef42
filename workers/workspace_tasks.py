"""The Celery tasks of workspace operations, and the record of each call's use of its workspace.

Both operations are acked on receipt (at most once): an upload's bytes are read once from Redis
and cannot be delivered again, and a worker that dies mid-way leaves only a staging directory,
which the sweep removes (workers/workspaces.py). The API waits for the answer; an operation whose
API has stopped waiting (its deadline passed, also when Celery's `expires` has not dropped it
first) does nothing.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import suppress
from typing import Any

import redis
from celery import Task, shared_task
from celery.signals import task_postrun

from shared.errors import InternalError
from shared.schema import TOOLS
from shared.workspaces import CREATE_TASK, DELETE_TASK, Operation, Registry
from workers import runtime
from workers.tasks import RunwardenTask
from workers.workspaces import USE_THROTTLE_S, Operations, Outcome, remove_tree

log = logging.getLogger("runwarden.workspaces")
_TOOL_TASKS = frozenset(tool.task_name for tool in TOOLS.values())
_recorded: dict[tuple[str, str], float] = {}  # this process's last record of each run's use


def _perform(task: RunwardenTask, kind: str, message: dict[str, Any]) -> dict[str, Any]:
    if time.time() > message["deadline"]:
        log.info("workspace %s of %s/%s not done: its API stopped waiting", kind, message["tenant"], message["run_id"])
        return {"status": "expired"}
    ctx = task.ctx
    operations = Operations(ctx.settings, ctx.redis, ctx.runner, ctx.sandbox_owner, ctx.sandbox_error)
    try:
        outcome = operations.perform(kind, message)
    except Exception:  # a bug must still answer, never leave the API waiting for nothing
        log.exception("workspace %s of %s/%s failed", kind, message["tenant"], message["run_id"])
        error = InternalError("The operation failed unexpectedly; it has been logged.")
        outcome = Outcome(error.status, error.problem())
    Operation(ctx.redis, message["op_id"]).answer(outcome.status, outcome.body)
    for path in outcome.leftovers:  # an old tree renamed aside: removed once the client has its answer
        remove_tree(path)
    return {"status": outcome.status}


@shared_task(bind=True, base=RunwardenTask, name=CREATE_TASK, acks_late=False, ignore_result=True)
def workspace_create(self: RunwardenTask, message: dict[str, Any]) -> dict[str, Any]:
    return _perform(self, "create", message)


@shared_task(bind=True, base=RunwardenTask, name=DELETE_TASK, acks_late=False, ignore_result=True)
def workspace_delete(self: RunwardenTask, message: dict[str, Any]) -> dict[str, Any]:
    return _perform(self, "delete", message)


@task_postrun.connect(weak=False)
def record_use(sender: Task | None = None, args: tuple[Any, ...] | None = None, **_: Any) -> None:
    """After a tool call (its answer is already recorded, so no client waits on this): the run's
    workspace was used now, and is recorded if its first call made it. At most once a second per
    run and process; the sweep measures it again (workers/workspaces.py)."""
    if sender is None or sender.name not in _TOOL_TASKS or not args or not isinstance(args[0], dict):
        return
    tenant, run_id = str(args[0]["tenant"]), str(args[0]["run_id"])
    now = time.monotonic()
    if now - _recorded.get((tenant, run_id), -USE_THROTTLE_S) < USE_THROTTLE_S:
        return
    if len(_recorded) > 10_000:
        _recorded.clear()
    _recorded[(tenant, run_id)] = now
    ctx = runtime.current()
    if os.path.isdir(ctx.settings.workspaces / tenant / run_id):  # the call may not have run at all
        with suppress(redis.RedisError):  # a lost record costs a late measurement, not the call
            Registry(ctx.redis).used(tenant, run_id)
