"""Following a shell call's events in its Redis Stream: replay, then live, in order.

One read loop, XREAD BLOCK from the last seq read, serves both a late reader's replay and live
delivery, so there is no gap and no duplicate. MCP's progress notifications read through it (a
thread each, for the minute a call may last); WebSocket streams are read by `api/fanout.py`, which
shares the quiet-state check below.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from shared import keys
from shared.keys import Status
from shared.records import Records

if TYPE_CHECKING:  # api.runtime builds the stream server, which reads through this module
    from api.runtime import Runtime

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
        """Nothing new to read: "done" (the reader already has the exit event), "live", or "expired"."""
        return verdict(call_states(self.rt.records, [self.task_id])[self.task_id], self.last)


# What a quiet reader learns of its call: its status (None: no such call any more) and the seq of
# its newest logged event (0: none).
CallState = tuple[Status | None, int]


def call_states(records: Records, task_ids: Iterable[str]) -> dict[str, CallState]:
    """The state of each call, in one round trip for all of them; a running call whose worker died
    is turned into `lost` here, which logs its exit event (its stream then reads it)."""
    ids = list(task_ids)
    pipe = records.client.pipeline(transaction=False)
    for task_id in ids:
        pipe.hget(keys.task(task_id), "status")
        pipe.xrevrange(keys.log(task_id), count=1)
    replies = pipe.execute()
    states: dict[str, CallState] = {}
    for index, task_id in enumerate(ids):
        status, newest = replies[2 * index], replies[2 * index + 1]
        states[task_id] = (Status(status.decode()) if status else None,
                           int(newest[0][0].split(b"-")[0]) if newest else 0)
        if states[task_id][0] is Status.RUNNING:
            records.reap(task_id)
    return states


def verdict(state: CallState, last: int) -> str:
    """"done" (the call has ended and the reader, at `last`, has every event), "live", or "expired"."""
    status, newest = state
    if status is None:
        return "expired"
    if status.terminal and newest <= last:
        return "done"
    return "live"
