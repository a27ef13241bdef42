"""apply_file_patches: several files changed as one, all or nothing, also when a worker dies midway.

1. Locks: every path's file lock (the one single patches take), in sorted order, so two calls that
   share paths never wait for each other in a cycle.
2. Check: every entry goes through `files.compute` (path, base sha, the diff applies) before
   anything is written; the first entry that fails fails the call, with its `failed_index`.
   A dry run answers here.
3. Stage: missing directories are made and each new content is written next to its target, under
   a name of this task's (`.<name>.rw-<task id>.set`), and flushed to disk.
4. Intent: one script checks that every lock is still the set's, makes the locks last as long as
   the intent (no other writer gets in until the set is finished), records the intent (each
   target and its staged name, or a delete, and the call's response) and takes the set's lease.
5. Renames, in entry order, each after renewing the lease; then the outcome is recorded and every
   lock released in one script.

A worker that dies after 4 leaves the intent: its redelivered task (file tasks are acked late), or
any worker that waits for one of the set's locks once the lease has expired, takes the lease over,
finishes the renames and records the outcome. Renames are idempotent (a staged name that is gone
was renamed), and so are deletes, since the locks keep every other patch out: readers end up
seeing all old files or all new. A worker that dies before 4 changed nothing; its redelivery
starts again, over the staged files of the first delivery.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery.exceptions import Reject

from shared import keys, records
from shared.errors import FileNotFound, RunwardenError, Unavailable
from shared.keys import Status
from shared.records import Records
from workers import workspace
from workers.files import LOCK_WAIT_S, Change, PatchApplier, compute, parse_diff
from workers.holds import Holds

log = logging.getLogger("runwarden.patch_sets")
KEEP_BYTES = 64 * 1024 * 1024  # new contents held from check to stage; past this they are worked out again
MAX_ATTEMPTS = 3  # as every file call (workers/tasks.py)


@dataclass
class _Checked:
    """One entry that passed the check: where it goes, and what it becomes (the old bytes are let
    go: only the file's mode and owner are kept)."""

    entry: dict[str, Any]  # as sent: path, diff, base_sha
    name: str
    dir_fd: int | None  # its directory (a dup, closed with the call); None: made when staging
    outcome: dict[str, Any]
    like: workspace.FileState  # mode and owner of the file replaced; data None if there is none
    new_data: bytes | None  # None for a delete, or when over KEEP_BYTES (worked out again when staging)

    @property
    def path(self) -> str:
        return str(self.entry["path"])

    @classmethod
    def of(cls, entry: dict[str, Any], name: str, dir_fd: int | None, change: Change) -> _Checked:
        current = change.current
        like = workspace.FileState(None if current.data is None else b"", current.mode, current.uid, current.gid)
        return cls(entry, name, dir_fd, change.outcome, like, change.new_data)


def staged_name(name: str, task_id: str) -> str:
    return f".{name[:180]}.rw-{task_id}.set"


def response_body(task_id: str, call: dict[str, Any], result: dict[str, Any]) -> bytes:
    """The call's 200 answer, as every file call's (workers/tasks.py), recorded with the intent."""
    body = {"task_id": task_id, "call_id": call["call_id"], "tool_name": call["tool_name"],
            "status": Status.COMPLETED.value, "result": result}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class PatchSets:
    def __init__(self, client: redis.Redis, applier: PatchApplier, records_: Records,
                 workspace_of: Callable[[str, str], Path], holds: Holds, *, lease_s: int, intent_ttl_s: int,
                 worker: str) -> None:
        self.client, self.applier, self.records = client, applier, records_
        self.workspace_of, self.holds = workspace_of, holds
        self.lease_ms, self.intent_ttl_ms = lease_s * 1000, intent_ttl_s * 1000
        self.worker = worker
        self._commit = client.register_script(records.COMMIT_SET)
        self._renew_lease = client.register_script(records.RENEW_LEASE)
        self._take_over = client.register_script(records.TAKE_OVER_SET)
        self._renew_locks = client.register_script(records.RENEW_LOCKS)
        applier.finish_stuck = self.finish_stuck

    @staticmethod
    def lock_keys(call: dict[str, Any]) -> list[str]:
        """The set's file locks, in the one order every caller takes them."""
        return sorted(keys.file_lock(call["tenant"], call["run_id"], entry["path"])
                      for entry in call["parameters"]["patches"])

    def run(self, task_id: str, call: dict[str, Any], attempts: int) -> None:
        """Apply the set (or finish it, if an earlier delivery committed it) and record its outcome;
        a refusal raises, with `failed_index`, for the caller to record."""
        if self._resume(task_id) or self._ended(task_id):
            return
        if attempts > MAX_ATTEMPTS:
            raise Unavailable("The call was delivered too many times; its workers died.")
        parameters, locks = call["parameters"], self.lock_keys(call)
        ws = self.workspace_of(call["tenant"], call["run_id"])
        with ExitStack() as stack:
            deadline = time.monotonic() + LOCK_WAIT_S
            for index, lock in enumerate(locks):
                self.applier.lock(lock, task_id, deadline, on_wait=lambda: self._hold("patch_set_waits", task_id))
                self._hold(f"patch_set_locked_{index}", task_id)
            checked = [self._check(stack, ws, index, entry) for index, entry in enumerate(parameters["patches"])]
            result = {"dry_run": parameters.get("dry_run", False), "files": [c.outcome for c in checked]}
            response = response_body(task_id, call, result)
            if not result["dry_run"]:
                self._renew_locks(keys=locks, args=[task_id, records.LOCK_TTL_MS])  # the check may have been long
                steps = self._stage_all(stack, ws, task_id, checked)
                actor = self._record_intent(task_id, call, locks, steps, result, response, ws)
                try:
                    if not self._rename_all(task_id, actor, steps, [c.dir_fd for c in checked]):
                        return  # another actor took the set over: it records the outcome
                    self._hold("before_finish", task_id)
                    self._finish(task_id, result, response, locks)
                except Unavailable:
                    raise  # steps the workspace refused: the call's failure, recorded by the caller
                except Exception as exc:
                    # Committed: a failure recorded now would free the locks over half-renamed files.
                    # Delivered again, the task finishes the set from its intent.
                    log.exception("patch set %s: interrupted after its commit; it will be finished again", task_id)
                    raise Reject(exc, requeue=True) from exc
                return
            self._finish(task_id, result, response, locks)

    def finish_stuck(self, owner: str) -> bool:
        """For a worker waiting on a lock `owner` holds: if `owner` is a committed set whose actor
        stopped renewing its lease, take it over and finish it. True if it was finished here."""
        intent = _set_intent(self.client.get(keys.patch_intent(owner)))
        actor = self._actor()
        if intent is None or not self._claim(owner, actor):
            return False
        log.warning("finishing patch set %s for its worker, which stopped", owner)
        self._roll_forward(owner, intent, actor)
        return True

    def _resume(self, task_id: str) -> bool:
        """A delivery that finds its own committed intent finishes it (waiting for the earlier
        delivery's lease to lapse); True when the call has its outcome."""
        intent = _set_intent(self.client.get(keys.patch_intent(task_id)))
        if intent is None:
            return False
        actor = self._actor()
        deadline = time.monotonic() + 2 * self.lease_ms / 1000 + LOCK_WAIT_S
        while not self._claim(task_id, actor):
            view = self.records.get(task_id)
            if view is None or view.status.terminal:
                return True  # another actor finished it meanwhile
            if time.monotonic() > deadline:
                raise Unavailable("The patch set is being finished by another worker; retry later.")
            time.sleep(0.05)
        self._roll_forward(task_id, intent, actor)
        return True

    def _ended(self, task_id: str) -> bool:
        """Whether another actor finished this set (and let its intent go) since this delivery
        started: it must not run again, even where the files would pass its checks once more."""
        view = self.records.get(task_id)
        return view is not None and view.status.terminal

    def _actor(self) -> str:
        """Who does a set's renames (the lease's value): this worker, process, and attempt."""
        return f"{self.worker}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def _claim(self, owner: str, actor: str) -> bool:
        return bool(self._take_over(keys=[keys.patch_intent(owner), keys.lease(owner)], args=[actor, self.lease_ms]))

    def _roll_forward(self, owner: str, intent: dict[str, Any], actor: str) -> None:
        """Finish a committed set from its intent alone (any worker can), and record its outcome."""
        ws = self.workspace_of(intent["tenant"], intent["run_id"])
        try:
            if not self._rename_all(owner, actor, intent["steps"], None, ws):
                return
        except Unavailable as exc:
            self._fail(owner, intent, exc)
            return
        self._finish(owner, intent["result"], intent["response"].encode(), intent["locks"])

    def _fail(self, owner: str, intent: dict[str, Any], error: RunwardenError) -> None:
        """What tasks.py records for a call's failure, from the intent alone: a 503 frees the key."""
        ids = {name: json.loads(intent["response"])[name] for name in ("task_id", "call_id", "tool_name")}
        body = json.dumps(error.problem() | ids, ensure_ascii=False, separators=(",", ":")).encode()
        result = {"code": error.code, "message": error.detail, **error.extra}
        idem = self.client.hget(keys.task(owner), "idem")
        self.records.finish(owner, Status.FAILED, result, response=(error.status, body), release=intent["locks"])
        if idem is not None:
            self.client.delete(idem)

    def _check(self, stack: ExitStack, ws: Path, index: int, entry: dict[str, Any]) -> _Checked:
        """Entry `index` checked, nothing written: its directory may be missing (a creation)."""
        path = entry["path"]
        try:
            patch = parse_diff(entry["diff"])
            dir_fd, name = self._open_dir(stack, ws, path)
            change = compute(dir_fd, name, path, patch, entry["base_sha"], keep_open=self.applier.replaced)
        except RunwardenError as exc:
            exc.extra.setdefault("path", path)
            exc.extra["failed_index"] = index
            raise
        except OSError as exc:
            raise Unavailable(f"The file system refused: {exc.strerror or type(exc).__name__}.", path=path,
                              failed_index=index) from None
        return _Checked.of(entry, name, dir_fd, change)

    @staticmethod
    def _open_dir(stack: ExitStack, ws: Path, path: str, create: bool = False) -> tuple[int | None, str]:
        name = path.rsplit("/", 1)[-1]
        try:
            with workspace.parent_dir(ws, path, create=create) as (dir_fd, _):
                held = os.dup(dir_fd)
        except FileNotFound:
            return None, name  # a directory on the way does not exist yet
        stack.callback(os.close, held)
        return held, name

    def _stage_all(self, stack: ExitStack, ws: Path, task_id: str, checked: list[_Checked]) -> list[dict[str, Any]]:
        """Each new content written and flushed beside its target; the steps of the intent. On a
        failure the staged files go (nothing was changed) and it raises."""
        kept = 0
        for entry in checked:
            if entry.new_data is not None and (kept := kept + len(entry.new_data)) > KEEP_BYTES:
                entry.new_data = None  # let it go: worked out again when staged
        steps: list[dict[str, Any]] = []
        try:
            for entry in checked:
                steps.append(self._stage(stack, ws, task_id, entry))
        except BaseException:
            for entry, step in zip(checked, steps):
                if step["staged"] is not None and entry.dir_fd is not None:
                    _unlink_quietly(entry.dir_fd, step["staged"])
            raise
        self._hold("patch_set_staged", task_id)
        return steps

    def _stage(self, stack: ExitStack, ws: Path, task_id: str, entry: _Checked) -> dict[str, Any]:
        if entry.outcome["deleted"]:
            return {"path": entry.path, "staged": None}
        if entry.dir_fd is None:
            entry.dir_fd, _ = self._open_dir(stack, ws, entry.path, create=True)
        assert entry.dir_fd is not None
        data = entry.new_data
        if data is None:  # let go over KEEP_BYTES: worked out again, from the file checked (under its lock)
            sent = entry.entry
            data = compute(entry.dir_fd, entry.name, entry.path, parse_diff(sent["diff"]), sent["base_sha"]).new_data
            assert data is not None
        staged = staged_name(entry.name, task_id)
        _unlink_quietly(entry.dir_fd, staged)  # an earlier delivery's
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=entry.dir_fd)
        try:
            workspace.fill(fd, data, workspace.new_file_metadata(entry.dir_fd, entry.like))
        except BaseException:
            _unlink_quietly(entry.dir_fd, staged)
            raise
        finally:
            os.close(fd)
        entry.new_data = None
        return {"path": entry.path, "staged": staged}

    def _record_intent(self, task_id: str, call: dict[str, Any], locks: list[str], steps: list[dict[str, Any]],
                       result: dict[str, Any], response: bytes, ws: Path) -> str:
        """The commit point; returns the actor that holds the lease. A lock lost meanwhile (expired,
        taken) refuses it: the staged files go, and nothing was changed."""
        actor = self._actor()
        intent = {"kind": "set", "tenant": call["tenant"], "run_id": call["run_id"], "steps": steps,
                  "locks": locks, "result": result, "response": response.decode()}
        committed = self._commit(keys=[keys.patch_intent(task_id), keys.lease(task_id), *locks],
                                 args=[task_id, json.dumps(intent), self.intent_ttl_ms, actor, self.lease_ms])
        if not committed:
            for step in steps:
                if step["staged"] is not None:
                    with workspace.parent_dir(ws, step["path"]) as (dir_fd, _):
                        _unlink_quietly(dir_fd, step["staged"])
            raise Unavailable("A file's lock was lost while the patch set was prepared; nothing was changed, retry.")
        return actor

    def _rename_all(self, owner: str, actor: str, steps: list[dict[str, Any]], dir_fds: list[int | None] | None,
                    ws: Path | None = None) -> bool:
        """Every step, in order, each only while `actor` still holds the lease (False once it does
        not: the actor that took over finishes). `dir_fds`: the first delivery's open directories;
        else each path is walked again from `ws`."""
        failed = []
        for index, step in enumerate(steps):
            self._hold(f"patch_set_rename_{index}", owner)
            if not self._renew_lease(keys=[keys.lease(owner), keys.task(owner)], args=[actor, self.lease_ms]):
                return False
            try:
                fd = dir_fds[index] if dir_fds is not None else None
                if fd is not None:
                    _apply_step(fd, step["path"].rsplit("/", 1)[-1], step["staged"])
                else:
                    assert ws is not None
                    with workspace.parent_dir(ws, step["path"]) as (dir_fd, name):
                        _apply_step(dir_fd, name, step["staged"])
            except (OSError, RunwardenError) as exc:
                # Only a workspace changed under the set by what takes no lock (the run's own shell)
                # gets here: the other steps still land, and the answer says which did not.
                log.error("patch set %s: step %d (%s) failed: %s", owner, index, step["path"], exc)
                failed.append(index)
        if failed:
            raise Unavailable(f"The workspace changed under the patch set: entries {failed} could not be put in "
                              "place; the others were.", failed_index=failed[0])
        return True

    def _finish(self, task_id: str, result: dict[str, Any], response: bytes, locks: list[str]) -> None:
        self.records.finish(task_id, Status.COMPLETED, result, response=(200, response), release=locks)
        self.client.delete(keys.patch_intent(task_id))

    def _hold(self, moment: str, task_id: str) -> None:
        if (hold := self.holds.point(moment, task_id)) is not None:
            hold()


def _set_intent(raw: bytes | None) -> dict[str, Any] | None:
    """A committed patch set's intent (a single patch's intent is its outcome alone)."""
    if raw is None:
        return None
    try:
        intent = json.loads(raw)
    except ValueError:
        return None
    return intent if isinstance(intent, dict) and intent.get("kind") == "set" else None


def _apply_step(dir_fd: int, name: str, staged: str | None) -> None:
    """Rename the staged file in, or delete the target; done already (gone) is done."""
    try:
        if staged is None:
            os.unlink(name, dir_fd=dir_fd)
        else:
            os.replace(staged, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
