"""How a shell call ended: one type for what its result and its `exit` event both say (contract
sections 2, 5 and 13), its fields listed here once.

`termination` is decided from what runwarden knows of the call (its own timer, cap and cancel, the
signals it delivered, the cgroup's OOM kills), in the order of `Termination`; the exit code comes
last, only to tell a death by signal from an exit. `usage` is read from the call's cgroup, and is
null where the host gives none (see workers/cgroups.py).
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from shared.keys import Status


class Termination(str, enum.Enum):
    """Why the command ended; when several apply, the first listed here is the one reported."""

    CANCELLED = "cancelled"  # DELETE of the call: SIGTERM, then SIGKILL after the grace
    TIMED_OUT = "timed_out"  # timeout_ms passed: SIGTERM, then SIGKILL after the grace
    OUTPUT_CAPPED = "output_capped"  # its output passed RUNWARDEN_OUTPUT_CAP: SIGKILL
    OOM_KILLED = "oom_killed"  # its tree hit the memory limit and the kernel killed a process of it
    SIGNALED = "signaled"  # it died of a signal: sent on the stream, or from inside the sandbox
    EXITED = "exited"  # it ended by itself, with its exit code
    LOST = "lost"  # its worker died; nothing is known of how the command ended


def decide(*, cancelled: bool, timed_out: bool, capped: bool, oom_kills: int, died_of_signal: bool) -> Termination:
    """The termination of a call that ran to its end; `died_of_signal`: the command's own process
    ended by a signal (whoever sent it), rather than by exiting."""
    if cancelled:
        return Termination.CANCELLED
    if timed_out:
        return Termination.TIMED_OUT
    if capped:
        return Termination.OUTPUT_CAPPED
    if oom_kills:
        return Termination.OOM_KILLED
    return Termination.SIGNALED if died_of_signal else Termination.EXITED


@dataclass(frozen=True)
class Usage:
    """What the call's whole process tree used, from its cgroup; None where it cannot be read."""

    peak_memory_bytes: int | None = None
    cpu_time_ms: int | None = None
    oom_kills: int = 0  # processes of the tree the kernel's OOM killer ended during the call

    def fields(self) -> dict[str, Any]:
        return {"peak_memory_bytes": self.peak_memory_bytes, "cpu_time_ms": self.cpu_time_ms}


UNMEASURED = Usage()


@dataclass(frozen=True)
class ShellEnd:
    """The summary of a shell call, as both its result and its exit event carry it. A call that never
    ran, or whose worker died, knows only its termination (if any): the rest stays null."""

    termination: Termination | None
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool = False
    duration_ms: int | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    stdout_sha256: str | None = None
    stderr_sha256: str | None = None
    truncated: bool = False
    usage: Usage = UNMEASURED

    def fields(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code, "signal": self.signal, "timed_out": self.timed_out,
            "duration_ms": self.duration_ms, "stdout_bytes": self.stdout_bytes, "stderr_bytes": self.stderr_bytes,
            "stdout_sha256": self.stdout_sha256, "stderr_sha256": self.stderr_sha256, "truncated": self.truncated,
            "termination": self.termination.value if self.termination else None, **self.usage.fields(),
        }

    def never_ran_fields(self) -> dict[str, Any]:
        """What the result of a call that never ran (or was lost) adds to its code and message."""
        return {"termination": self.termination.value if self.termination else None, **self.usage.fields()}

    def exit_event(self, status: Status, error: str | None = None) -> str:
        """The call's exit event; `seq` is assigned when it is logged (shared/records.py)."""
        event = {"type": "exit", "seq": 0, "status": status.value, **self.fields()}
        if error is not None:
            event["error"] = error
        return json.dumps(event, separators=(",", ":"))


NOT_RUN = ShellEnd(termination=None)  # a call that failed before its command started
