"""The file tools: read a file, and apply a patch with compare-and-swap on its git blob SHA."""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import redis

from shared import keys
from shared.errors import BaseShaMismatch, FileNotFound, PatchDoesNotApply, Unavailable
from workers import patching, workspace
from workers.patching import ZERO_SHA, git_blob_sha

LOCK_TIMEOUT_S = 60
LOCK_WAIT_S = 30

# KEYS: lock. ARGV: owner (task id), ttl ms. Free, or already ours (a redelivery): take it.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) or redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# KEYS: lock. ARGV: owner. Only the owner releases.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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


class PatchApplier:
    """Applies one patch call; safe to run again for the same task after a redelivery."""

    def __init__(self, client: redis.Redis, intent_ttl_s: int) -> None:
        self.client = client
        self.intent_ttl_s = intent_ttl_s
        self._acquire = client.register_script(_ACQUIRE)
        self._unlock = client.register_script(_RELEASE)

    def apply(self, ws: Path, tenant: str, run_id: str, task_id: str, path: str, diff: str,
              base_sha: str) -> dict[str, Any]:
        try:
            patch = patching.parse(diff.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:
            raise PatchDoesNotApply("The diff is not encodable as UTF-8.") from None
        lock_key = keys.file_lock(tenant, run_id, path)
        if not self._lock(lock_key, task_id):
            raise Unavailable("The file is locked by another patch; retry later.")
        try:
            with workspace.parent_dir(ws, path, create=patch.creates or base_sha == ZERO_SHA) as (dir_fd, name):
                return self._apply_locked(dir_fd, name, task_id, path, patch, base_sha)
        finally:
            self._unlock(keys=[lock_key], args=[task_id])

    def _lock(self, lock_key: str, task_id: str) -> bool:
        """Take the file's lock, owned by the task: a redelivery of a task whose worker was killed
        holding it takes it over at once instead of waiting for it to expire."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while not self._acquire(keys=[lock_key], args=[task_id, LOCK_TIMEOUT_S * 1000]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _apply_locked(self, dir_fd: int, name: str, task_id: str, path: str,
                      patch: patching.FilePatch, base_sha: str) -> dict[str, Any]:
        current = workspace.read(dir_fd, name)
        current_sha = git_blob_sha(current.data) if current.data is not None else ZERO_SHA
        redelivered = self._own_earlier_write(task_id, current_sha)
        if redelivered is not None:
            return redelivered
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
        # Written before the file changes: a redelivered message that finds the file at new_sha
        # knows the write was its own and reports success instead of a 412.
        self.client.set(keys.patch_intent(task_id), json.dumps(outcome), ex=self.intent_ttl_s)
        if patch.deletes:
            workspace.delete(dir_fd, name)
        else:
            workspace.replace(dir_fd, name, new_data, current)
        return outcome

    def _own_earlier_write(self, task_id: str, current_sha: str) -> dict[str, Any] | None:
        raw = self.client.get(keys.patch_intent(task_id))
        if raw is None:
            return None
        outcome = json.loads(raw)
        return outcome if outcome["new_sha"] == current_sha else None

