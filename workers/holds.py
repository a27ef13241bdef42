"""Test mode only: hold a worker at a named moment of one call, so a fault test can act exactly there.

Off unless `RUNWARDEN_TEST_HOLD_DIR` is set (never in production): then every hold point is one
`None` check. With it set, a test arms a hold by creating `<dir>/<task_id>.<moment>`; the first
process to reach that moment of that call takes the file (unlink is atomic, so one does, and a
redelivered message runs on), writes its pid to `<task_id>.<moment>.held`, and waits there until
`<task_id>.<moment>.go` exists. A test SIGKILLs it while held, or lets it go on.

Moments: `mid_write` (half of a patch's new bytes written, before the rest and the fsync) and
`before_finish` (a file tool has done its work, its outcome is not yet recorded). A patch set
(workers/patch_sets.py) adds `patch_set_start` (a delivery has started the call, before anything
else), `patch_set_locked_<i>` (its i-th lock, in sorted order, is taken), `patch_set_waits` (the
first time it has to wait for a lock), `patch_set_staged` (every new content is staged, the intent
not yet recorded) and `patch_set_rename_<i>` (committed, before step i).
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

MAX_HOLD_S = 300  # a test that forgot its hold must not hang the worker for ever


class Holds:
    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def point(self, moment: str, task_id: str) -> Callable[[], None] | None:
        """What to call at `moment` of the call `task_id`; None when holds are off."""
        if self.directory is None:
            return None
        return functools.partial(self._reach, moment, task_id)

    def _reach(self, moment: str, task_id: str) -> None:
        assert self.directory is not None
        armed = self.directory / f"{task_id}.{moment}"
        try:
            armed.unlink()
        except FileNotFoundError:
            return  # not armed for this call, or already taken by an earlier delivery
        held = armed.with_name(f"{armed.name}.held")
        staging = armed.with_name(f"{armed.name}.held-{os.getpid()}")
        staging.write_text(str(os.getpid()))
        os.replace(staging, held)  # the test never reads a half-written pid
        go, deadline = armed.with_name(f"{armed.name}.go"), time.monotonic() + MAX_HOLD_S
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
