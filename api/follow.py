"""Following a shell call's events in its Redis Stream: replay, then live, in order.

One read loop, XREAD BLOCK from the last seq read, serves both a late reader's replay and live
delivery, so there is no gap and no duplicate. The WebSocket stream and MCP's progress
notifications both read through it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from api.runtime import Runtime
from shared import keys

READ_COUNT = 4  # events of up to ~128 KiB of output: what a stalled client can pin in the API
MAX_BLOCK_MS = 5000  # below the Redis client's socket timeout
EXIT_PREFIX = '{"type":"exit"'


class Follower:
    """Reads one call's events after `after_seq`. Once `events` stops, `ended` says why: "exit"
    (the exit event was read), "done" (the call has ended and every event was read), "expired" (no
    such call any more), or None (the caller's budget ran out)."""

    def __init__(self, rt: Runtime, task_id: str, after_seq: int = 0) -> None:
        self.rt, self.task_id, self.last = rt, task_id, after_seq
        self.ended: str | None = None

    def events(self, budget_ms: Callable[[], int]) -> Iterator[str | None]:
        """Each event's JSON text as logged, in order; None after a quiet read (nothing new for a
        while), so the caller can look after its client. `budget_ms()`, asked before each read, is
        how long the caller may wait now; it stops when that is not positive."""
        log_key = keys.log(self.task_id)
        block_ms = 1  # the first read only asks what is there, so a finished replay ends at once
        while (budget := budget_ms()) > 0:
            block_ms = max(1, min(block_ms, self.rt.settings.lease_s * 1000, budget))
            found = self.rt.redis.xread({log_key: f"{self.last}-1"}, count=READ_COUNT, block=block_ms)
            block_ms = MAX_BLOCK_MS
            if not found:
                if (state := self._quiet_state()) != "live":
                    self.ended = state
                    return
                yield None
                continue
            for entry_id, fields in found[0][1]:
                event = fields[b"e"].decode()
                self.last = int(entry_id.split(b"-")[0])
                yield event
                if event.startswith(EXIT_PREFIX):
                    self.ended = "exit"
                    return

    def _quiet_state(self) -> str:
        """Nothing new to read: "done" (the reader already has the exit event), "live", or "expired".

        A running call whose worker died is turned into `lost` here, which logs its exit event.
        """
        view = self.rt.records.get(self.task_id)
        if view is None:
            return "expired"
        if view.status.value == "running":
            self.rt.records.reap(self.task_id)
        elif view.status.terminal:
            newest = self.rt.redis.xrevrange(keys.log(self.task_id), count=1)
            if not newest or int(newest[0][0].split(b"-")[0]) <= self.last:
                return "done"
        return "live"
