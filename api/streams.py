"""The open WebSocket streams of one API process, on one asyncio event loop beside gunicorn's threads.

A handshake is checked on a gunicorn thread like any request (`api/routes/stream.py`); once accepted,
its socket is handed here and the thread goes back to plain HTTP. So an open stream costs no thread:
a stream is a socket, a `WsConnection` and a `Stream` (a few KiB), read by the process's one
`Fanout`, and health checks, tool calls and replays keep every thread whatever the streams do.

Admission is counted here: beyond RUNWARDEN_MAX_STREAMS, or while draining, a handshake is refused
(503) before the upgrade. A sweeper, every SWEEP_S for all streams at once, does what needs a clock:
pings (a half-open connection is dropped when its pong does not come), a client that stopped reading
(dropped after RUNWARDEN_STREAM_SEND_TIMEOUT), closes that are never answered, tokens that expired
or were revoked (closed with 4401 within 2 s), and a look at the call of every quiet stream (a call
whose worker died becomes `lost`, whose exit event its streams then read). SIGTERM starts a drain:
no new stream; streams of calls that end get their exit event; after RUNWARDEN_DRAIN_S the rest are
closed with 1001 and resume elsewhere with `after_seq`.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from redis.exceptions import RedisError
from websockets.server import ServerProtocol

from api import metrics
from api.fanout import Fanout, Stream
from api.follow import call_states, verdict
from api.wsconn import WsConnection
from shared.errors import SchemaInvalid
from shared.records import Records
from shared.revocations import Watcher
from shared.schema import SIGNALS, loads
from shared.settings import Settings

SWEEP_S = 0.5
PING_INTERVAL_S = 25  # a silent stream stays open through idle-timeout proxies
PING_TIMEOUT_S = 20
CLOSE_TIMEOUT_S = 5
MAX_QUIET_S = 5  # a quiet stream looks at its call at least this often (and every lease)
POLICY_VIOLATION, GOING_AWAY, REVOKED = 1008, 1001, 4401
log = logging.getLogger("runwarden.stream")


@dataclass(frozen=True)
class Opening:
    """What the handshake established: the call, where the client resumes, and its grant's limits."""

    task_id: str
    after_seq: int
    jti: str | None
    tenant: str
    exp: float


class StreamServer:
    """Admission (any thread) and the event loop's thread, started with the first stream."""

    def __init__(self, settings: Settings, records: Records, revocations: Watcher) -> None:
        self.settings, self.records, self.revocations = settings, records, revocations
        self.quiet_check_s = min(settings.lease_s, MAX_QUIET_S)
        self._lock = threading.Lock()
        self.admitted = 0  # streams handed over or being handed over, until their socket closed
        self.draining = False
        self.drained = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: set[Stream] = set()  # the loop's own, like everything below
        self.fanout: Fanout | None = None
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="runwarden-streams")  # signals, call states
        self._drain_deadline: float | None = None
        self._seen_revocations: frozenset[str] | None = None
        self._checking = False

    # --- any thread --------------------------------------------------------------------------

    def admit(self) -> bool:
        """Take a place for one more stream; False when full or draining (the caller answers 503)."""
        with self._lock:
            if self.draining or self.admitted >= self.settings.max_streams:
                return False
            self.admitted += 1
        metrics.STREAMS_OPEN.inc()
        return True

    def release(self) -> None:
        metrics.STREAMS_OPEN.dec()
        with self._lock:
            self.admitted -= 1
            if self.draining and self.admitted == 0:
                self.drained.set()

    def hand_over(self, sock: socket.socket, buffered: bytes, protocol: ServerProtocol, opening: Opening) -> None:
        """Serve an admitted stream whose handshake `protocol` accepted (its 101 not yet written)."""
        loop = self._started()
        sock.setblocking(False)
        loop.call_soon_threadsafe(self._spawn_open, sock, buffered, protocol, opening)

    def begin_drain(self) -> None:
        """SIGTERM: admit no stream; close the open ones with 1001 after RUNWARDEN_DRAIN_S."""
        with self._lock:
            self.draining = True
            if self.admitted == 0:
                self.drained.set()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._start_drain)

    def wait_drained(self) -> bool:
        return self.drained.wait(self.settings.drain_s + CLOSE_TIMEOUT_S + 2 * SWEEP_S)

    def start(self) -> None:
        """Before the first hand-over: a RedisError here is still the handshake's 503."""
        self.revocations.start()
        self._started()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self.loop is None:
                ready = threading.Event()
                threading.Thread(target=self._run, args=(ready,), name="runwarden-streams", daemon=True).start()
                ready.wait()
            assert self.loop is not None
            return self.loop

    def _run(self, ready: threading.Event) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.call_soon(self._begin, ready)
        self.loop.run_forever()

    # --- the event loop's thread -------------------------------------------------------------

    def _begin(self, ready: threading.Event) -> None:
        self.fanout = Fanout(self.settings, self.finish)
        self.fanout.start()
        self.fanout.spawn(self._sweep_forever())
        if self.draining:
            self._start_drain()
        ready.set()

    def _spawn_open(self, sock: socket.socket, buffered: bytes, protocol: ServerProtocol, opening: Opening) -> None:
        assert self.fanout is not None
        self.fanout.spawn(self._open(sock, buffered, protocol, opening))

    async def _open(self, sock: socket.socket, buffered: bytes, protocol: ServerProtocol, opening: Opening) -> None:
        assert self.loop is not None and self.fanout is not None
        stream = Stream(opening.task_id, opening.after_seq, opening.jti, opening.tenant, opening.exp)
        fanout = self.fanout
        stream.conn = WsConnection(protocol, buffered, on_text=lambda text: self._signal(stream, text),
                                   on_writable=lambda: fanout.writable(stream), on_lost=lambda: self._lost(stream))
        try:
            await self.loop.connect_accepted_socket(lambda: stream.conn, sock)
        except OSError:  # the client went away between the handshake and now
            sock.close()
            self.release()
            return
        self.streams.add(stream)
        if stream.conn.lost:
            self._lost(stream)
        else:
            self.fanout.add(stream)

    def finish(self, stream: Stream, code: int, reason: str) -> None:
        """End a stream: out of every read, then its closing handshake (the sweeper bounds it)."""
        if not stream.ended:
            stream.ended = True
            assert self.fanout is not None
            self.fanout.remove(stream)
            stream.conn.close(code, reason)

    def _lost(self, stream: Stream) -> None:
        if stream in self.streams:
            self.streams.discard(stream)
            stream.ended = True
            assert self.fanout is not None
            self.fanout.remove(stream)
            self.release()

    def _signal(self, stream: Stream, text: bytes) -> None:
        """Client → server: `{"type": "signal", "signal": "SIGINT"}` reaches the call's process group,
        also when it is sent before the command has started."""
        try:
            order = loads(text)  # as every body: a repeated "signal" key is no order
        except (TypeError, ValueError, SchemaInvalid):
            return
        if isinstance(order, dict) and order.get("type") == "signal" and order.get("signal") in SIGNALS:
            assert self.loop is not None
            sent = self.loop.run_in_executor(self.executor, self.records.send_signal, stream.task_id, order["signal"])
            sent.add_done_callback(_log_failure)

    def _start_drain(self) -> None:
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.settings.drain_s
            log.info("draining %d open streams (at most %d s)", len(self.streams), self.settings.drain_s)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self._sweep()
            except Exception:  # a bug here must not stop the pings and drops of every other stream
                log.exception("stream sweep failed")

    def _sweep(self) -> None:
        now, wall = time.monotonic(), time.time()
        revoked = self._revocations_changed()
        going_away = self._drain_deadline is not None and now >= self._drain_deadline
        due: list[Stream] = []
        for stream in list(self.streams):
            if self._keep_alive(stream.conn, now) and not stream.ended:
                ending = self._ending(stream, wall, revoked, going_away)
                if ending is not None:
                    self.finish(stream, *ending)
                elif now - max(stream.active_at, stream.checked_at) >= self.quiet_check_s or not stream.checked_at:
                    due.append(stream)
        if due and not self._checking:
            assert self.fanout is not None
            self._checking = True
            self.fanout.spawn(self._check(due))

    def _keep_alive(self, conn: WsConnection, now: float) -> bool:
        """Pings and timeouts of one connection; False once it is being dropped."""
        if conn.paused_at is not None and now - conn.paused_at > self.settings.stream_send_timeout_s:
            log.warning("dropping a stream whose client stopped reading (%d s); it may resume with after_seq",
                        self.settings.stream_send_timeout_s)
            conn.abort()
            return False
        if conn.closing_at is not None:
            if now - conn.closing_at > CLOSE_TIMEOUT_S and conn.paused_at is None and conn.transport is not None:
                conn.transport.close()  # what is buffered still goes out, then the FIN
            return False
        if conn.pinged_at is not None and now - conn.pinged_at > PING_TIMEOUT_S:
            conn.abort()  # half-open: nothing came back
            return False
        if now - conn.heard_at > PING_INTERVAL_S:
            conn.ping()
        return True

    def _ending(self, stream: Stream, wall: float, revoked: bool, going_away: bool) -> tuple[int, str] | None:
        if revoked and stream.jti is not None and self.revocations.revoked(stream.jti, stream.tenant):
            return REVOKED, "token revoked"  # the call goes on: another token of the run may watch or cancel it
        if wall >= stream.exp:
            return POLICY_VIOLATION, "token expired"
        if going_away:
            return GOING_AWAY, "server going away; reconnect with after_seq"
        return None

    def _revocations_changed(self) -> bool:
        entries = self.revocations.entries
        changed = entries is not self._seen_revocations
        self._seen_revocations = entries
        return changed

    async def _check(self, due: list[Stream]) -> None:
        """Look at the calls of quiet streams, all in one round trip: ended and fully read, or gone."""
        assert self.loop is not None
        try:
            states = await self.loop.run_in_executor(self.executor, call_states, self.records,
                                                     {stream.task_id for stream in due})
        except RedisError as exc:
            log.warning("looking at quiet streams' calls failed: %s", type(exc).__name__)
            states = {}
        finally:
            self._checking = False
        now = time.monotonic()
        for stream in due:
            stream.checked_at = now
            state = states.get(stream.task_id)
            found = verdict(state, stream.last) if state is not None else "live"
            if found == "done":
                self.finish(stream, 1000, "done")
            elif found == "expired":
                self.finish(stream, POLICY_VIOLATION, "expired")


def _log_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a stream's signal was not sent: %s", type(future.exception()).__name__)
