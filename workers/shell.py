"""One shell call from spawn to exit: read both pipes, publish, obey timeout, cap, signals, cancel."""
from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis

from shared import keys
from shared.keys import Status
from shared.paths import WHOLE_WORKSPACE, ShellView
from shared.endings import ShellEnd, Usage, decide
from shared.schema import SIGNALS
from shared.settings import Settings
from workers.relay import Publisher, StreamCopy
from workers.sandbox import Process, Runner

READ_BYTES = 128 * 1024
READS_PER_FLUSH = 8
PIPE_BYTES = 1024 * 1024
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
POLL_S = 0.2
SUBSCRIBE_TIMEOUT_S = 5.0  # Redis confirms at once; a connection that does not is given up
SIGNAL_RETRY_S = 0.002  # while a signal waits for the command to exist (bwrap's set-up: ~5 ms)
# A buffer per thread, read into and copied out of: os.read would allocate 128 KiB and shrink it on
# every read, which fragmented the pool process's heap (its RSS crept up in ~1 MiB steps).
_buffers = threading.local()


def _read_buffer() -> memoryview:
    if not hasattr(_buffers, "view"):
        _buffers.view = memoryview(bytearray(READ_BYTES))
    return _buffers.view


@dataclass
class Outcome:
    status: Status
    result: dict[str, Any]
    exit_event: str


@dataclass
class _Run:
    """Mutable state of one running call."""

    process: Process
    deadline: float
    kill_at: float | None = None
    timed_out: bool = False
    cancelled: bool = False
    truncated: bool = False
    streams: dict[int, StreamCopy] = field(default_factory=dict)
    signals_read: int = 0  # how many of the call's sent signals (keys.signals) are taken
    pending: list[int] = field(default_factory=list)  # taken, to be sent once the command exists


def signal_name(exit_code: int) -> str | None:
    if 128 < exit_code < 128 + signal.NSIG:
        try:
            return signal.Signals(exit_code - 128).name
        except ValueError:
            return None
    return None


class ShellCall:
    def __init__(self, settings: Settings, client: redis.Redis, runner: Runner, task_id: str,
                 refresh_lease: Callable[[], None]) -> None:
        self.settings = settings
        self.client = client
        self.runner = runner
        self.task_id = task_id
        self.refresh_lease = refresh_lease
        self.publisher = Publisher(client, task_id, settings.stream_retention_s)

    def run(self, command: str, workspace: Path, cwd: str, network: bool, timeout_ms: int,
            control: redis.client.PubSub, channel: str, start: Callable[[], tuple[str, ...] | None],
            view: ShellView = WHOLE_WORKSPACE, new_run: bool = False) -> Outcome:
        """`control`: the pool process's control connection, listening on `channel` once the call
        has started; `start`: the call's start, made once, while its sandbox is set up: the signals
        clients sent before it, in order, or None if the call is not to run (NotStarted is raised
        then); `view`: what of the workspace the token's allowed_paths show the command;
        `new_run`: its workspace was made by this call (Runner.spawn)."""
        started = time.monotonic()
        process = self.runner.spawn(command, workspace, cwd, network, view, go=lambda: start() is not None,
                                    new_run=new_run)
        run = _Run(process, deadline=started + timeout_ms / 1000)
        self._take_listed(run, start() or ())
        run.streams = {
            process.stdout: StreamCopy("stdout", self.settings.http_output_bytes),
            process.stderr: StreamCopy("stderr", self.settings.http_output_bytes),
        }
        try:
            self._pump(run, control, channel)
        finally:
            process.kill()  # whatever is left of the tree; the PID namespace takes the rest
            process.wait()
            usage = process.usage()  # the sandbox's whole tree is gone by now
            process.close()
        return self._outcome(run, started, usage)

    def _pump(self, run: _Run, control: redis.client.PubSub, channel: str) -> None:
        selector = selectors.DefaultSelector()
        for fd in run.streams:
            os.set_blocking(fd, False)
            _grow_pipe(fd)
            selector.register(fd, selectors.EVENT_READ)
        control_fd = self._listen(run, control, channel, selector, None)
        next_lease = time.monotonic() + self.settings.lease_s / 3
        open_pipes = set(run.streams)
        while open_pipes:
            now = time.monotonic()
            # Wake at least every POLL_S to notice a command that exited while a child holds its pipes.
            poll_s = SIGNAL_RETRY_S if run.pending else POLL_S
            wake = min(run.deadline, next_lease, run.kill_at or float("inf"), now + poll_s)
            for key, _ in selector.select(max(0.0, wake - now)):
                if key.fd == control_fd:
                    control_fd = self._listen(run, control, channel, selector, control_fd)
                elif not self._drain_pipe(run, key.fd):
                    selector.unregister(key.fd)
                    open_pipes.discard(key.fd)
            self._deliver(run)
            self.publisher.flush()
            now = time.monotonic()
            if now >= next_lease:
                self.refresh_lease()
                next_lease = now + self.settings.lease_s / 3
            if now >= run.deadline and not run.timed_out and run.kill_at is None:
                run.timed_out = True
                self._terminate(run)
            if run.process.poll() is not None and run.kill_at is None:
                run.process.kill()  # the command is done: leftovers (`cmd &`, `setsid`) end with it
                run.kill_at = float("inf")
            if run.kill_at is not None and now >= run.kill_at:
                run.process.kill()
                run.kill_at = float("inf")
        selector.close()

    def _drain_pipe(self, run: _Run, fd: int) -> bool:
        """Read what the pipe holds, a few reads at most, so one Redis round trip carries several
        events; False at EOF."""
        for _ in range(READS_PER_FLUSH):
            got = self._read_pipe(run, fd)
            if got is not True:
                return got is None  # None: drained for now; False: EOF
        return True

    def _read_pipe(self, run: _Run, fd: int) -> bool | None:
        """One read: True with data, None when the pipe is empty, False at EOF.
        Past the cap the command is stopped, never silently cut."""
        buffer = _read_buffer()
        try:
            got = os.readv(fd, [buffer])
        except BlockingIOError:
            return None
        data = bytes(buffer[:got])
        copy = run.streams[fd]
        if not data:
            self._emit(copy, copy.cutter.flush())
            return False
        if run.truncated:
            return True  # draining a killed command; nothing more is emitted
        room = self.settings.output_cap_bytes - sum(s.kept for s in run.streams.values())
        if len(data) >= room:
            data = data[:room]
            run.truncated = True
            run.process.kill()
        self._emit(copy, copy.cutter.feed(data))
        if run.truncated:
            self._emit(copy, copy.cutter.flush())
        return True

    def _emit(self, copy: StreamCopy, piece: bytes) -> None:
        if piece:
            copy.take(piece)
            self.publisher.add(copy.name, piece)

    def _read_control(self, run: _Run, control: redis.client.PubSub, channel: str) -> None:
        listened = channel.encode()
        while (message := control.get_message(timeout=0)) is not None:
            if message.get("type") != "message" or message.get("channel") != listened:
                continue
            try:
                order = json.loads(message["data"])
            except (TypeError, ValueError):
                continue
            if not isinstance(order, dict) or order.get("task") != self.task_id:
                continue  # a late order for an earlier call of this process
            if order.get("cancel"):
                run.cancelled = True
                self._terminate(run)
            elif order.get("signal") in SIGNALS:
                self._take_signal(run, order["signal"], order.get("n"))

    def _take_signal(self, run: _Run, name: str, place: object) -> None:
        """A signal announced on the control channel, `place` being its number in the call's list."""
        if place is None:  # from an API that keeps no list (an older version, mid-upgrade): as it comes
            self._queue_signal(run, SIGNALS[name])
            return
        if not isinstance(place, int) or place <= run.signals_read:
            return  # taken already, from the list, when the call started
        if place > run.signals_read + 1:
            self._catch_up(run)  # some went by while no one listened: take them all, in order
            return
        self._take_listed(run, [name])

    def _catch_up(self, run: _Run) -> None:
        listed = self.client.lrange(keys.signals(self.task_id), run.signals_read, -1)
        self._take_listed(run, [raw.decode() for raw in listed])

    def _take_listed(self, run: _Run, names: Iterable[str]) -> None:
        """The next signals of the call's list, in order."""
        for name in names:
            run.signals_read += 1
            if name in SIGNALS:
                run.pending.append(SIGNALS[name])
        self._deliver(run)

    def _queue_signal(self, run: _Run, signum: int) -> None:
        run.pending.append(signum)
        self._deliver(run)

    def _deliver(self, run: _Run) -> None:
        """Send the queued signals once the command exists; until then the loop retries every
        SIGNAL_RETRY_S, so a signal sent as the call starts is not lost."""
        if run.pending and run.process.started():
            for signum in run.pending:
                run.process.signal(signum)
            run.pending.clear()

    def _listen(self, run: _Run, control: redis.client.PubSub, channel: str, selector: selectors.BaseSelector,
                fd: int | None) -> int:
        """Act on what the control connection (watched as `fd`, if yet) holds. If Redis dropped it
        (a restart, a failover, an idle timeout), listen on a new one, and honour a cancel flagged
        while none was listening. Returns the fd to watch."""
        try:
            self._read_control(run, control, channel)
            if fd is not None:
                return fd
        except redis.ConnectionError:
            if fd is not None:
                selector.unregister(fd)
            control.reset()
            listen_for_orders(control, channel)
            if not run.cancelled and self.client.hexists(keys.task(self.task_id), "cancel"):
                run.cancelled = True
                self._terminate(run)
            self._catch_up(run)  # signals sent while no one listened
        fd = control.connection._sock.fileno()  # type: ignore[union-attr]
        selector.register(fd, selectors.EVENT_READ)
        return fd

    def _terminate(self, run: _Run) -> None:
        """SIGTERM now (once the command exists), SIGKILL after the grace period."""
        self._queue_signal(run, signal.SIGTERM)
        if run.kill_at is None:
            run.kill_at = time.monotonic() + self.settings.kill_grace_s

    def _outcome(self, run: _Run, started: float, usage: Usage) -> Outcome:
        exit_code = run.process.wait()  # ended: its code, 128 + N for a death by signal N
        died_of_signal = run.process.ended_by_signal()
        stdout, stderr = run.streams.values()
        termination = decide(cancelled=run.cancelled, timed_out=run.timed_out, capped=run.truncated,
                             oom_kills=usage.oom_kills, died_of_signal=died_of_signal)
        end = ShellEnd(
            termination, exit_code=exit_code, signal=signal_name(exit_code), timed_out=run.timed_out,
            duration_ms=int((time.monotonic() - started) * 1000), stdout_bytes=stdout.size,
            stderr_bytes=stderr.size, stdout_sha256=stdout.sha.hexdigest(), stderr_sha256=stderr.sha.hexdigest(),
            truncated=run.truncated, usage=usage,
        )
        status = Status.CANCELLED if run.cancelled else Status.COMPLETED
        result = {**end.fields(), **stdout.result_fields(), **stderr.result_fields()}
        return Outcome(status, result, end.exit_event(status))


def listen_for_orders(control: Any, channel: str) -> None:
    """Have this pool process's control connection listen on its channel, which it does from its
    first shell call on (one subscription, not one per call), dropping what earlier calls left
    unread. A connection Redis dropped since (a restart, a failover, an idle timeout) is replaced.
    A new subscription is confirmed before the call is started: a cancel published once the start
    has recorded the channel then finds the process listening."""
    try:
        while control.get_message(timeout=0) is not None:
            pass
    except redis.ConnectionError:
        control.reset()
    if control.subscribed:
        return
    try:
        control.subscribe(channel)
        deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            message = control.get_message(timeout=left)
            if message is not None and message.get("type") == "subscribe":
                return
        raise redis.ConnectionError("Redis did not confirm the control channel's subscription")
    except redis.ConnectionError:
        control.reset()  # the next call tries again, on a new connection
        raise


def _grow_pipe(fd: int) -> None:
    """A 1 MiB pipe lets a fast writer get ahead between our reads (Linux only; best effort)."""
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass
