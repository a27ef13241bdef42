"""Celery tasks. Each is thin: claim the call, run the tool, record the outcome.

The outcome of a call is written to runwarden's own records (not only Celery's result backend,
which forgets): the task record for GET, and the idempotency record for replays. What a task
returns only feeds Celery's "succeeded" log line (results are ignored), so it is a summary: file
contents and command output stay out of the worker's logs.
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack, suppress
from collections.abc import Sequence
from typing import Any, Callable

import redis
from celery import Task, shared_task
from celery.exceptions import Reject

from shared import keys, paths
from shared.errors import InternalError, RunwardenError, SandboxUnavailable, Unavailable
from shared.keys import Status
from shared.endings import NOT_RUN
from shared.records import Records
from workers import metrics, runtime, workspace
from workers.files import Prepared, read_file as read_file_tool
from workers.runtime import Runtime
from workers.sandbox import Ahead, Key, NotStarted
from workers.shell import ShellCall, listen_for_orders

log = logging.getLogger("runwarden.tasks")
MAX_FILE_ATTEMPTS = 3


class RunwardenTask(Task):
    """Base for every tool task: this pool process's runtime, and the one place outcomes are recorded."""

    abstract = True

    @property
    def ctx(self) -> Runtime:
        return runtime.current()

    def file_call(self, call: dict[str, Any], tool: Callable[[bytes | None], dict[str, Any]],
                  lock: str | None = None, prepared: Prepared | None = None) -> dict[str, Any]:
        """Run a file tool once per call, even when its message is delivered again. `lock` is
        taken with the start if free (the tool gets the task's earlier intent, else None and waits
        for it itself) and released with the outcome. A `prepared` patch's intent is recorded with
        the lock, and its bytes written while the start's reply is on its way."""
        records, task_id = self.ctx.records, self.request.id
        started = records.start(task_id, self.ctx.name, reentrant=True, lock=lock,
                                proposed=prepared.intent if prepared else b"",
                                meanwhile=prepared.write if prepared else None)
        if started.status not in ("running", "cancel"):
            log.info("file call %s not run again: it is %s", task_id, started.status)
            return {"status": started.status}
        metrics.call_started(call["tool_name"], started.queue_wait_s)
        if started.attempts > MAX_FILE_ATTEMPTS:
            error: RunwardenError = Unavailable("The call was delivered too many times; its workers died.")
            return self._record_error(call, error, lock)

        def work() -> None:
            result = tool(started.intent)
            if before_finish := self.ctx.holds.point("before_finish", task_id):
                before_finish()
            body = _json({"task_id": task_id, "call_id": call["call_id"], "tool_name": call["tool_name"],
                          "status": Status.COMPLETED.value, "result": result})
            records.finish(task_id, Status.COMPLETED, result, response=(200, body.encode()), release=lock)
        return self.guarded(call, work, lock)

    def guarded(self, call: dict[str, Any], work: Callable[[], None],
                release: str | Sequence[str] | None) -> dict[str, Any]:
        """Run `work`, which records the call's success; any failure is recorded here, freeing the
        locks `release` names, so a call always ends."""
        try:
            work()
        except Reject:
            raise  # the work is to be delivered again, its outcome not recorded (a committed patch set)
        except RunwardenError as exc:
            return self._record_error(call, exc, release)
        except OSError as exc:
            log.exception("file call %s failed", self.request.id)
            error = Unavailable(f"The file system refused: {exc.strerror or type(exc).__name__}.")
            return self._record_error(call, error, release)
        except Exception:  # a bug must still end the call, never leave it running with its key held
            log.exception("file call %s failed", self.request.id)
            return self._record_error(call, InternalError("The call failed unexpectedly; it has been logged."), release)
        return {"status": Status.COMPLETED.value}

    def _record_error(self, call: dict[str, Any], error: RunwardenError,
                      release: str | Sequence[str] | None) -> dict[str, Any]:
        task_id = self.request.id
        body = _json(error.problem() | {"task_id": task_id, "call_id": call["call_id"],
                                        "tool_name": call["tool_name"]})
        # A single patch's path is its call's own; a patch set's failing entry is named with it.
        result = {"code": error.code, "message": error.detail,
                  **{k: v for k, v in error.extra.items() if k != "path" or "failed_index" in error.extra}}
        self.ctx.records.finish(task_id, Status.FAILED, result, response=(error.status, body.encode()),
                                release=release)
        if error.status >= 500:
            # A server failure is not the call's outcome: free the key so a retry can run it.
            self.ctx.redis.delete(keys.idempotency(call["tenant"], call["idem_key"]))
        return {"status": Status.FAILED.value, "error": error.code}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@shared_task(bind=True, base=RunwardenTask, name="runwarden.ping")
def ping(self: RunwardenTask) -> str:
    return "pong"


@shared_task(bind=True, base=RunwardenTask, name="runwarden.read_file", acks_late=True,
             reject_on_worker_lost=True, ignore_result=True)
def read_file(self: RunwardenTask, call: dict[str, Any]) -> dict[str, Any]:
    def tool(_: bytes | None) -> dict[str, Any]:
        ws = self.ctx.workspace(call["tenant"], call["run_id"])
        return read_file_tool(ws, call["parameters"]["path"])
    return self.file_call(call, tool)


@shared_task(bind=True, base=RunwardenTask, name="runwarden.apply_file_patch", acks_late=True,
             reject_on_worker_lost=True, ignore_result=True)
def apply_file_patch(self: RunwardenTask, call: dict[str, Any]) -> dict[str, Any]:
    patches, p = self.ctx.patches, call["parameters"]
    midway = self.ctx.holds.point("mid_write", self.request.id)

    def tool(held: bytes | None) -> dict[str, Any]:
        if prepared is not None and held == b"":  # the lock is ours, recorded with the prepared intent
            if prepared.commit():
                return prepared.outcome
            patches.forget_intent(self.request.id)  # another patch wrote the file since it was read
        ws = self.ctx.workspace(call["tenant"], call["run_id"])
        return patches.apply(ws, call["tenant"], call["run_id"], self.request.id, p["path"], p["diff"],
                             p["base_sha"], held, midway)
    try:
        with ExitStack() as stack:
            prepared = None
            with suppress(OSError):  # then the tool meets the same failure, and it is recorded
                ws = self.ctx.workspace(call["tenant"], call["run_id"])
                prepared = patches.prepare(stack, ws, p["path"], p["diff"], p["base_sha"], midway)
            return self.file_call(call, tool, lock=keys.file_lock(call["tenant"], call["run_id"], p["path"]),
                                  prepared=prepared)
    finally:
        patches.after_answer()


@shared_task(bind=True, base=RunwardenTask, name="runwarden.apply_file_patches", acks_late=True,
             reject_on_worker_lost=True, ignore_result=True)
def apply_file_patches(self: RunwardenTask, call: dict[str, Any]) -> dict[str, Any]:
    """All or nothing (workers/patch_sets.py): the locks are taken by the set, not the start."""
    ctx, task_id = self.ctx, self.request.id
    started = ctx.records.start(task_id, ctx.name, reentrant=True)
    if started.status not in ("running", "cancel"):
        log.info("file call %s not run again: it is %s", task_id, started.status)
        return {"status": started.status}
    if hold := ctx.holds.point("patch_set_start", task_id):
        hold()
    try:
        return self.guarded(call, lambda: ctx.patch_sets.run(task_id, call, started.attempts),
                            ctx.patch_sets.lock_keys(call))
    finally:
        ctx.patches.after_answer()


@shared_task(bind=True, base=RunwardenTask, name="runwarden.execute_shell_command", acks_late=False,
             ignore_result=True)
def execute_shell_command(self: RunwardenTask, call: dict[str, Any]) -> dict[str, Any] | None:
    """At most once: acked on receipt; a second delivery finds the call no longer queued and stops."""
    ctx, task_id = self.ctx, self.request.id
    start = ShellStart(ctx, task_id, call["tool_name"], ctx.control, ctx.control_channel)
    run_seen = ctx.has_workspace(call["tenant"], call["run_id"])  # before this call makes it
    ran = _run_shell(ctx, task_id, call, start, new_run=not run_seen)
    if ran is None or start() is None:  # started here if a failure came before its sandbox
        if start.deaf:
            # The message is already acked: end the call, or it would stay queued with no exit event.
            status, result, exit_json = _could_not_run(redis.ConnectionError)
            ctx.records.finish(task_id, status, result, exit_json=exit_json)
        log.info("shell call %s not started: it is %s", task_id, start.status or "unsubscribed")
        return None
    status, result, exit_json = ran
    others = ctx.records.finish(task_id, status, result, exit_json=exit_json)
    if status is not Status.FAILED:
        _prepare_next(ctx, call, run_seen, others)
    metrics.output_relayed(result)
    count_output(ctx.redis, call["tenant"], result)
    if ctx.runner is not None:
        ctx.runner.after_call()
    return {"status": status.value, "exit_code": result.get("exit_code"), "error": result.get("code")}


class ShellStart:
    """A shell call's start (queued → running), made once: by its runner while the sandbox is set
    up (so its round trips overlap bwrap's work), or by the task after a failure that came first.
    The pool process listens on its control `channel` first (listen_for_orders), and the start
    records that channel, so a cancel or signal that sees `running` reaches the call. Called: the
    signals sent before the call started, or None if it may not start (`deaf`: the process could
    not listen, and the call was not started)."""

    def __init__(self, ctx: Runtime, task_id: str, tool_name: str, control: Any, channel: str) -> None:
        self.ctx, self.task_id, self.tool_name = ctx, task_id, tool_name
        self.control, self.channel = control, channel
        self.status = ""
        self.deaf = False
        self.signals: tuple[str, ...] = ()

    def __call__(self) -> tuple[str, ...] | None:
        if not self.status and not self.deaf:
            try:
                listen_for_orders(self.control, self.channel)
            except redis.ConnectionError:
                log.exception("shell call %s: its pool process cannot listen on its control channel", self.task_id)
                self.deaf = True
                return None
            started = self.ctx.records.start(self.task_id, self.ctx.name, control=self.channel)
            self.status, self.signals = started.status, started.signals
            if started.status == "running":
                metrics.call_started(self.tool_name, started.queue_wait_s)
        return self.signals if self.status == "running" else None


def _prepare_next(ctx: Runtime, call: dict[str, Any], run_seen: bool, others: int | None) -> None:
    """Once a call has answered, its run's next call is likely to come soon (an agent makes its
    calls in a row): the runner may start its sandbox now (workers/sandbox/keeper.py), for as long
    as the call's token is good. Asked only for a run that had come before this call (`run_seen`:
    its workspace was there; many runs make one call) and with no other call queued or running
    (`others`, as the call's end found them: that one comes at once, before a sandbox could be
    ready, and a busy pool has no CPU to spare for sandboxes that may never be used). A message
    without the token's exp (an older API) gets none."""
    if ctx.runner is None or not run_seen or others != 0 or not isinstance(call.get("exp"), int):
        return
    ws = workspace.run_path(ctx.settings.workspaces, call["tenant"], call["run_id"])  # its call just ran there
    key = Key(str(ws), bool(call.get("network", False)), _view(call))
    jti = call.get("jti")
    ctx.runner.prepare(Ahead(key, call["tenant"], jti if isinstance(jti, str) else None, float(call["exp"])))


def count_output(client: redis.Redis, tenant: str, result: dict[str, Any]) -> None:
    """Add a shell call's output to its tenant's hour (the `output_bytes_per_hour` quota), once
    the call has answered: no client waits on this round trip."""
    total = (result.get("stdout_bytes") or 0) + (result.get("stderr_bytes") or 0)
    if total:
        key = keys.output_bytes(tenant, int(time.time()) // 3600)
        pipe = client.pipeline(transaction=False)
        pipe.incrby(key, total)
        pipe.expire(key, 7200)
        pipe.execute()


def _run_shell(ctx: Runtime, task_id: str, call: dict[str, Any], start: ShellStart,
               new_run: bool) -> tuple[Status, Any, str] | None:
    """The call's outcome, or None if its start said it may not run (nothing of it ran)."""
    p = call["parameters"]
    try:
        if ctx.runner is None:
            raise SandboxUnavailable(ctx.sandbox_error or "No sandbox is configured on this worker.")
        ws = ctx.workspace(call["tenant"], call["run_id"])
        cwd = p.get("cwd") or ""
        if cwd:
            with workspace.parent_dir(ws, cwd + "/."):
                pass  # every component is a real directory, none a symlink
        shell = ShellCall(ctx.settings, ctx.redis, ctx.runner, task_id,
                          refresh_lease=lambda: ctx.records.refresh_lease(task_id, ctx.name))
        outcome = shell.run(p["command"], ws, cwd, call.get("network", False), p["timeout_ms"], start.control,
                            start.channel, start, _view(call), new_run)
        return outcome.status, outcome.result, outcome.exit_event
    except NotStarted:
        return None
    except RunwardenError as exc:
        if isinstance(exc, SandboxUnavailable):
            metrics.sandbox_failed()
        result = {"code": exc.code, "message": exc.detail}
        return Status.FAILED, result, NOT_RUN.exit_event(Status.FAILED, error=exc.code)
    except Exception as exc:  # Redis, the OS or a bug: the call ends as failed, never silently lost
        log.exception("shell call %s could not run", task_id)
        return _could_not_run(type(exc))


def _view(call: dict[str, Any]) -> paths.ShellView:
    """What of the workspace the call's token shows its command. A message without allowed_paths
    (from an older API) shows it nothing, never everything."""
    return paths.shell_view(tuple(call.get("allowed_paths", ())))


def _could_not_run(cause: type[BaseException]) -> tuple[Status, dict[str, Any], str]:
    """A shell call that failed before its command could run: its status, result and exit event."""
    result = {"code": "unavailable", "message": f"The call could not run: {cause.__name__}."}
    return Status.FAILED, result, NOT_RUN.exit_event(Status.FAILED, error="unavailable")


def reap_lost_calls(records: Records, lease_s: int) -> int:
    """Turn running shell calls whose lease expired into `lost`; run periodically by each worker."""
    cutoff = int(time.time() * 1000) - lease_s * 1000
    return sum(records.reap(task_id) for task_id in records.running_since(cutoff))
