"""The one reader of Redis for every open stream of an API process.

Each shell call logs its events in a Redis Stream (`rw:log:<task>`, entry id `<seq>-1`). Instead of
a blocked Redis connection per client, two readers serve all of a process's streams, each with one
`XREAD BLOCK` over many keys from the last seq each stream delivered, so replay and live delivery are
one read, with no gap and no duplicate (an entry at or below a stream's seq is never sent again):

- the **hot** reader follows streams with something to read: just opened (their replay), or given an
  event in the last HOT_IDLE_S. Its key list is short, so it is cheap to read again and again;
- the **quiet** reader waits on every other stream at once: thousands of queued or silent calls.
  Its XREAD costs ~1.7 µs a key (8.5 ms for 5,000 keys here), so it is issued again at most every
  QUIET_MIN_INTERVAL_S, and a stream it finds an event for moves to the hot reader.

A reader is woken from its XREAD BLOCK (to read the keys of streams added meanwhile) by an entry
written to its own wake key, which is part of the XREAD: a wake that reaches Redis before the read
still ends it at once. A stream whose client is not reading (its transport's buffer is full) is left
out of every read until the kernel took what it was given: a slow client pins one batch (READ_COUNT
events) and its socket buffers, never a backlog.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError

from api.follow import READ_COUNT
from api.wsconn import WsConnection
from shared import connections, keys
from shared.settings import Settings

EXIT_PREFIX = b'{"type":"exit"'
HOT_BLOCK_MS = 2000  # the hot reader is woken for a new stream; this bounds a lost wake
QUIET_BLOCK_MS = 5000  # below the readers' socket timeout
SOCKET_TIMEOUT_S = 15
HOT_IDLE_S = 0.5
QUIET_MIN_INTERVAL_S = 0.25
ERROR_BACKOFF_S = 1.0
INTERRUPTED = 1011
log = logging.getLogger("runwarden.stream")


@dataclass(eq=False, slots=True)
class Stream:
    """One open stream: its call, how far its client got, and its grant's limits."""

    task_id: str
    last: int  # the seq of the last event sent (the client's after_seq at first)
    jti: str | None
    tenant: str
    exp: float  # the token's expiry (epoch seconds)
    key: bytes = b""
    conn: WsConnection = field(init=False)
    hot: bool = True
    active_at: float = field(default_factory=time.monotonic)  # the last event sent, or the opening
    checked_at: float = 0.0  # the last look at its call's state; 0: at the first sweep
    ended: bool = False

    def __post_init__(self) -> None:
        self.key = keys.log(self.task_id).encode()

    @property
    def ready(self) -> bool:
        return not self.ended and self.conn.paused_at is None and self.conn.open

    def deliver(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> bool:
        """Send the entries past `last`, in order; True once the exit event went out."""
        for entry_id, fields in entries:
            seq = int(entry_id.split(b"-", 1)[0])
            if seq <= self.last:
                continue
            self.last = seq
            event = fields[b"e"]
            self.conn.send_text(event)
            if event.startswith(EXIT_PREFIX):
                return True
        return False


class Reader:
    """One Redis connection in XREAD BLOCK, and the wake key that ends its wait."""

    def __init__(self, settings: Settings, control: aredis.Redis, instance: str, name: str) -> None:
        self.client = connections.connect_async(settings, single_connection=True, socket_timeout=SOCKET_TIMEOUT_S,
                                                socket_connect_timeout=2)
        self.control = control
        self.wake_key = keys.stream_wake(instance, name).encode()
        self.wake_id: bytes | str = "0-0"
        self.in_flight = False
        self.woken = False
        self.wanted = asyncio.Event()  # set by a wake while the reader has no key to read

    async def read(self, ids: dict[bytes, str], block_ms: int) -> list[Any]:
        self.in_flight, self.woken = True, False
        try:
            reply = await self.client.xread({**ids, self.wake_key: self.wake_id}, count=READ_COUNT, block=block_ms)
        finally:
            self.in_flight = False
        found = []
        for key, entries in reply or []:
            if key == self.wake_key:
                self.wake_id = entries[-1][0]
            else:
                found.append((key, entries))
        return found

    async def idle(self, timeout_s: float) -> None:
        """No stream to read for: wait for one without a Redis command (nor a wake key to write)."""
        self.wanted.clear()
        try:
            await asyncio.wait_for(self.wanted.wait(), timeout_s)
        except TimeoutError:
            pass

    def wake(self, spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        """End the current read (once), so that the next one has the keys added since it began."""
        if not self.in_flight:
            self.wanted.set()
        elif not self.woken:
            self.woken = True
            spawn(self._wake())

    async def _wake(self) -> None:
        pipe = self.control.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self.wake_key, 3600)
        try:
            await pipe.execute()
        except RedisError:
            self.woken = False  # the read itself fails on the same outage


class Fanout:
    """Every open stream of this process, read by a hot and a quiet Reader. Runs on the streams'
    event loop only; `finish` is how a stream ends (close frame, out of every read)."""

    def __init__(self, settings: Settings, finish: Callable[[Stream, int, str], None]) -> None:
        instance = uuid.uuid4().hex
        self.control = connections.connect_async(settings, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=2,
                                                 max_connections=8)
        self.hot_reader = Reader(settings, self.control, instance, "hot")
        self.quiet_reader = Reader(settings, self.control, instance, "quiet")
        self.hot: set[Stream] = set()
        self.quiet: set[Stream] = set()
        self.by_key: dict[bytes, set[Stream]] = {}
        self.finish = finish
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.spawn(self._follow(self.hot_reader, self.hot, HOT_BLOCK_MS, 0.0))
        self.spawn(self._follow(self.quiet_reader, self.quiet, QUIET_BLOCK_MS, QUIET_MIN_INTERVAL_S))

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self.tasks.discard)

    def add(self, stream: Stream) -> None:
        self.by_key.setdefault(stream.key, set()).add(stream)
        self.hot.add(stream)
        self.hot_reader.wake(self.spawn)

    def remove(self, stream: Stream) -> None:
        self.hot.discard(stream)
        self.quiet.discard(stream)
        followers = self.by_key.get(stream.key)
        if followers is not None:
            followers.discard(stream)
            if not followers:
                del self.by_key[stream.key]

    def writable(self, stream: Stream) -> None:
        """Its client took what it was sent: read for it again, at once."""
        if stream.key in self.by_key and not stream.ended:
            self._promote(stream)

    def _promote(self, stream: Stream) -> None:
        if not stream.hot:
            self.quiet.discard(stream)
            self.hot.add(stream)
            stream.hot = True
        self.hot_reader.wake(self.spawn)

    async def _follow(self, reader: Reader, streams: set[Stream], block_ms: int, min_interval_s: float) -> None:
        while True:
            started = time.monotonic()
            ids = self._ids(streams)
            if not ids:  # every stream of this tier waits for its client, or there is none
                await reader.idle(block_ms / 1000)
                continue
            try:
                found = await reader.read(ids, block_ms)
            except (RedisError, OSError) as exc:
                self._interrupt(ids, exc)
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            for key, entries in found:
                self._dispatch(key, entries)
            if streams is self.hot:
                self._demote_idle()
            if (pause := min_interval_s - (time.monotonic() - started)) > 0:
                await asyncio.sleep(pause)

    def _ids(self, streams: set[Stream]) -> dict[bytes, str]:
        """Each key to read, from the lowest seq of its ready streams (a faster one skips what it has)."""
        lowest: dict[bytes, int] = {}
        for stream in streams:
            if stream.ready and lowest.get(stream.key, stream.last) >= stream.last:
                lowest[stream.key] = stream.last
        return {key: f"{last}-1" for key, last in lowest.items()}

    def _dispatch(self, key: bytes, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        now = time.monotonic()
        for stream in list(self.by_key.get(key, ())):
            if not stream.ready or int(entries[-1][0].split(b"-", 1)[0]) <= stream.last:
                continue
            stream.active_at = now
            if stream.deliver(entries):
                self.finish(stream, 1000, "")
            else:
                self._promote(stream)

    def _demote_idle(self) -> None:
        cutoff = time.monotonic() - HOT_IDLE_S
        idle = [stream for stream in self.hot if stream.ready and stream.active_at < cutoff]
        for stream in idle:
            self.hot.discard(stream)
            self.quiet.add(stream)
            stream.hot = False
        if idle:
            self.quiet_reader.wake(self.spawn)

    def _interrupt(self, ids: dict[bytes, str], exc: BaseException) -> None:
        """Redis went away under a read: its streams end with 1011, and their clients resume with after_seq."""
        log.warning("stream reader interrupted: %s", type(exc).__name__)
        for key in ids:
            for stream in list(self.by_key.get(key, ())):
                self.finish(stream, INTERRUPTED, "stream interrupted; reconnect with after_seq")
