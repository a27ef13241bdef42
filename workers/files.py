"""The file tools: read a file, and apply a patch with compare-and-swap on its git blob SHA."""
from __future__ import annotations

import base64
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from shared import keys, records
from shared.errors import (
    BaseShaMismatch,
    FileNotFound,
    PatchDoesNotApply,
    RunwardenError,
    Unavailable,
)
from workers import patching, workspace
from workers.patching import ZERO_SHA, git_blob_sha

log = logging.getLogger("runwarden.files")
LOCK_WAIT_S = 30
STUCK_LOOK_S = 0.25  # how often a patch waiting for a lock looks at who holds it

# KEYS: lock, the task's patch intent. ARGV: owner (task id), ttl ms. The task's finish script
# releases the lock (records.py).
_ACQUIRE = records.TAKE_LOCK + "return take_lock(KEYS[1], KEYS[2], ARGV[1], ARGV[2])"


def read_file(ws: Path, path: str) -> dict[str, Any]:
    with workspace.parent_dir(ws, path) as (dir_fd, name):
        state = workspace.read(dir_fd, name)
    if state.data is None:
        raise FileNotFound("No such file in the workspace.", path=path)
    try:
        content, encoding = state.data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        content, encoding = base64.b64encode(state.data).decode("ascii"), "base64"
    return {"path": path, "sha": git_blob_sha(state.data), "size": len(state.data),
            "encoding": encoding, "content": content}


def parse_diff(diff: str) -> patching.FilePatch:
    """The diff's one-file patch; a diff with text no UTF-8 can hold does not apply."""
    try:
        return patching.parse(diff.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        raise PatchDoesNotApply("The diff is not encodable as UTF-8.") from None


@dataclass(frozen=True)
class Change:
    """One file's patch worked out: the file as read, its new bytes (None for a delete, or when
    there is nothing left to write), and the outcome the call answers with."""

    current: workspace.FileState
    new_data: bytes | None
    outcome: dict[str, Any]
    done: bool = False  # the file already holds this task's own write (a redelivery)

    @property
    def deletes(self) -> bool:
        return bool(self.outcome["deleted"])


def compute(dir_fd: int | None, name: str, path: str, patch: patching.FilePatch, base_sha: str, *,
            keep_open: list[int] | None = None, own: dict[str, Any] | None = None) -> Change:
    """The one step every patch takes, single or in a set, fast path or locked: read the file
    (`dir_fd` None: its directory does not exist yet), compare it with base_sha, apply the diff.
    `own`: the outcome this task recorded before an earlier delivery died; a file already at its
    new_sha is that write, a success rather than a 412. Raises the contract's refusals."""
    current = workspace.FileState(None) if dir_fd is None else workspace.read(dir_fd, name, keep_open=keep_open)
    current_sha = git_blob_sha(current.data) if current.data is not None else ZERO_SHA
    if own is not None and own["new_sha"] == current_sha:
        return Change(current, None, own, done=True)
    if current_sha != base_sha:
        if current.data is None:
            raise FileNotFound("No such file in the workspace.", path=path, current_sha=ZERO_SHA)
        raise BaseShaMismatch("The file is not at base_sha.", path=path, current_sha=current_sha)
    new_data = patching.apply(current.data or b"", patch)
    outcome = {
        "path": path,
        "base_sha": base_sha,
        "new_sha": ZERO_SHA if patch.deletes else git_blob_sha(new_data),
        "created": current.data is None,
        "deleted": patch.deletes,
    }
    return Change(current, None if patch.deletes else new_data, outcome)


@dataclass
class Prepared:
    """A patch worked out before its call's start took the file's lock: the file read (`read_id`,
    still held open), the outcome, and the new bytes, written to a nameless file while the start's
    round trip is on its way (`write`). Committed only under the lock, and only while the file is
    still the one read: every patch replaces its file with a new inode, and the old one is held open
    so its number cannot be reused, so an unchanged inode means no patch has written it since."""

    dir_fd: int
    name: str
    read_id: tuple[int, int] | None
    data: bytes
    metadata: tuple[int, int, int]
    fd: int
    outcome: dict[str, Any]
    written: bool = False
    midway: Callable[[], None] | None = None  # test mode: workers/holds.py

    @property
    def intent(self) -> bytes:
        return json.dumps(self.outcome).encode()

    def write(self) -> None:
        """Never raises: a failed write leaves the patch to the locked path, which meets it again."""
        try:
            workspace.fill(self.fd, self.data, self.metadata, self.midway)
            self.written = True
        except Exception:  # the reply to the start must still be read
            log.warning("a prepared patch could not be written; applying it the locked way", exc_info=True)

    def commit(self) -> bool:
        """Put the new bytes in place if the file is still the one read; False if it is not."""
        if not self.written or workspace.identity(self.dir_fd, self.name) != self.read_id:
            return False
        workspace.link_in(self.fd, self.dir_fd, self.name)
        return True


class PatchApplier:
    """Applies one patch call; safe to run again for the same task after a redelivery.

    The file's lock is owned by the task: taken by the call's start script when free (else waited
    for here), and released by its finish script with the outcome, whatever it was.
    """

    def __init__(self, client: redis.Redis, intent_ttl_s: int, workspaces: Path) -> None:
        self.client = client
        self.intent_ttl_s = intent_ttl_s
        self._acquire = client.register_script(_ACQUIRE)
        self.spare = workspace.SpareFile(workspaces)
        self.spare.restock()  # ready for the process's first patch
        # The file a call replaces (or deletes) stays open until the call has answered. The last
        # close of a file is what frees its blocks: 0.2 ms on ext4, spent inside the rename when
        # nothing holds the old file open, and after the answer when this does.
        self.replaced: list[int] = []
        # Set by workers/patch_sets.py: finishes the patch set owning a lock if its worker died.
        self.finish_stuck: Callable[[str], object] | None = None

    def apply(self, ws: Path, tenant: str, run_id: str, task_id: str, path: str, diff: str,
              base_sha: str, held: bytes | None, midway: Callable[[], None] | None = None) -> dict[str, Any]:
        """`held`: the task's earlier intent if the call's start took the file's lock (b"" if
        none), None if the lock is still to be taken. `midway`: test mode, workers/holds.py."""
        patch = parse_diff(diff)
        intent = held if held is not None else self._lock(keys.file_lock(tenant, run_id, path), task_id)
        with workspace.parent_dir(ws, path, create=patch.creates or base_sha == ZERO_SHA) as (dir_fd, name):
            return self._apply_locked(dir_fd, name, task_id, path, patch, base_sha, intent, midway)

    def prepare(self, stack: ExitStack, ws: Path, path: str, diff: str, base_sha: str,
                midway: Callable[[], None] | None = None) -> Prepared | None:
        """Work out the patch before the lock is taken, when that is simple: the file (or its
        absence) is at base_sha, its directory exists, the patch applies and does not delete, and a
        spare file is ready. Anything else (including every refusal) is None, left to `apply`."""
        try:
            patch = parse_diff(diff)
            if patch.deletes:
                return None
            dir_fd, name = stack.enter_context(workspace.parent_dir(ws, path))
            change = compute(dir_fd, name, path, patch, base_sha, keep_open=self.replaced)
        except (RunwardenError, OSError):
            return None
        fd = self.spare.take_nameless(dir_fd)
        if fd is None:
            return None
        stack.callback(os.close, fd)
        assert change.new_data is not None
        created = change.current.data is None
        read_id = None if created else workspace.identity_of(self.replaced[-1])  # the file read, held open
        return Prepared(dir_fd, name, read_id, change.new_data, workspace.new_file_metadata(dir_fd, change.current),
                        fd, change.outcome, midway=midway)

    def forget_intent(self, task_id: str) -> None:
        """Drop an intent recorded for a prepared patch that was not committed."""
        self.client.delete(keys.patch_intent(task_id))

    def after_answer(self) -> None:
        """Work that need not delay a patch's answer: let the replaced file go, make the next spare."""
        while self.replaced:
            os.close(self.replaced.pop())
        self.spare.restock()

    def _lock(self, lock_key: str, task_id: str) -> bytes:
        return self.lock(lock_key, task_id, time.monotonic() + LOCK_WAIT_S)

    def lock(self, lock_key: str, task_id: str, deadline: float,
             on_wait: Callable[[], None] | None = None) -> bytes:
        """Wait (until `deadline`, monotonic) for the file's lock, owned by the task; returns the
        task's earlier intent, b'' if none. Now and then the holder is looked at: a patch set whose
        worker died while renaming is finished for it (`finish_stuck`), else it would hold its
        locks until its message came back. `on_wait` runs once if the lock is not free at first."""
        next_look = time.monotonic() + STUCK_LOOK_S
        while (intent := self._acquire(keys=[lock_key, keys.patch_intent(task_id)],
                                       args=[task_id, records.LOCK_TTL_MS])) is None:
            if on_wait is not None:
                on_wait()
                on_wait = None
            now = time.monotonic()
            if now > deadline:
                raise Unavailable("The file is locked by another patch; retry later.")
            if self.finish_stuck is not None and now >= next_look:
                if (holder := self.client.get(lock_key)) is not None:
                    self.finish_stuck(holder.decode())
                next_look = now + STUCK_LOOK_S
            time.sleep(0.005)
        return intent

    def _apply_locked(self, dir_fd: int, name: str, task_id: str, path: str, patch: patching.FilePatch,
                      base_sha: str, intent: bytes, midway: Callable[[], None] | None) -> dict[str, Any]:
        change = compute(dir_fd, name, path, patch, base_sha, keep_open=self.replaced,
                         own=json.loads(intent) if intent else None)
        if change.done:
            return change.outcome  # this task's own write, before its worker died: success, not a 412
        outcome = change.outcome
        # Recorded before the file changes: a redelivered message that finds the file at new_sha
        # knows the write was its own and reports success instead of a 412.
        with self._setting(keys.patch_intent(task_id), json.dumps(outcome)) as confirmed:
            if change.new_data is None:
                confirmed()
                workspace.delete(dir_fd, name)
            else:
                workspace.replace(dir_fd, name, change.new_data, change.current, before_rename=confirmed,
                                  spare=self.spare, midway=midway)
        return outcome

    @contextmanager
    def _setting(self, key: str, value: str) -> Iterator[Callable[[], None]]:
        """SET key (expiring) is sent at once; call what this yields to wait for Redis's reply, so
        the round trip overlaps the disk's fsync. SET is idempotent: on connection trouble it is
        simply sent again the usual way, with the client's retries."""
        command = ("SET", key, value, "EX", self.intent_ttl_s)
        pool = self.client.connection_pool
        connection = pool.get_connection()
        unread = False

        def confirmed() -> None:
            nonlocal unread
            try:
                if unread:
                    unread = False
                    connection.read_response()
                    return
            except redis.ConnectionError:
                pass
            self.client.execute_command(*command)

        try:
            with suppress(redis.ConnectionError):
                connection.send_command(*command)
                unread = True
            yield confirmed
        finally:
            if unread:  # never read: its reply must not reach the connection's next user
                connection.disconnect()
            pool.release(connection)
