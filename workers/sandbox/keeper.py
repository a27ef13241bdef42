"""The keeper: one process beside each worker that starts a run's next sandbox while its agent
thinks, and hands it to whichever pool process takes that run's next call.

An agent's run makes its calls one after another, seconds apart. Once a call has ended, its pool
process asks the keeper to prepare (`Ahead`): the keeper starts the same sandbox a cold call would
get (workers/sandbox/bwrap.py: same argv, uid, limits, /etc, view of the workspace), in a cgroup
of its own, and leaves its shell blocked reading its command from its stdin. The call that comes
next claims it with its key (workspace, network, view); the keeper checks the sandbox is alive and
that the workspace and each path it binds are still the ones at their paths, and hands over its
pipes and a pidfd of its init (workers/sandbox/prepared.py). Nothing is handed twice. While it
holds a sandbox for a workspace, the workspace is marked beside the socket (`Offers`), so that a
call with none to take starts cold without asking.

Bounded: one sandbox per key, at most `RUNWARDEN_PREPARED_SANDBOXES` in all (the least recently
prepared makes room), each killed after `RUNWARDEN_PREPARED_IDLE` seconds unclaimed, at its token's
exp, when its token's jti is revoked, when its workspace is deleted or replaced (here, by the
worker: `forget`; on another host: the workspace at its path is another directory), and when the
keeper is paused. One that dies is dropped.

The keeper is bwrap's parent, and `--die-with-parent` follows the spawning thread: it spawns from
its only thread. bwrap passes every inheritable fd into the sandbox: subprocess closes all but
those named. A claim that fails midway kills the sandbox. The socket is a path (0600, in a 0700
directory no sandbox binds), never an abstract socket, and a peer must be root or this worker's
uid (SO_PEERCRED); the pool processes run as that uid, the sandboxes as another when the worker
is root, and cannot see the path in any case.

`python -m workers.sandbox.keeper --socket PATH [--parent-fd N]`: started by the worker's main
process (workers/lifecycle.py), which it outlives by nothing: EOF on the parent fd stops it.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import logging
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from shared import connections, keys
from shared.paths import ShellView
from shared.revocations import is_revoked, watch_entry
from shared.settings import Settings
from workers import usage
from workers import workspace as workspace_files
from workers.cgroups import CallGroup, Cgroups, charged_bytes, group_name, remove_now
from workers.sandbox.base import Ahead, Key, kill_tree, let_commands_start_with_default_signals
from workers.sandbox.build import build_runner
from workers.sandbox import orphans
from workers.sandbox.bwrap import BwrapRunner, Launched, _close, _open_view
from workers.sandbox.prepared import MAX_MESSAGE, offer_name, offers_dir, peer_uid

log = logging.getLogger("runwarden.keeper")

TICK_S = 0.25  # expiry, identity and revocation checks
REVOCATION_POLL_S = 0.5  # as the API's Watcher: a revoked token's sandboxes go within a second
CLAIM_WAIT_S = 0.5  # a claim for a sandbox still starting waits this long for it at most
EXPIRY_MARGIN_S = 1.0  # a token this close to its exp gets no sandbox ahead
STATS_KEPT = 1024  # workspaces whose hits and misses `status` reports


@dataclass
class Held:
    """One sandbox this keeper started: starting, ready, claimed, then reaped."""

    id: int
    ahead: Ahead
    launched: Launched
    group: CallGroup | None
    meter: usage.Meter
    identity: tuple[Any, ...]
    bwrap_pidfd: int
    ready_since: float = field(default_factory=time.monotonic)
    child: int | None = None  # the sandbox's init, once bwrap has said it
    pidfd: int | None = None  # of the init
    status_buffer: bytes = b""
    waiters: list[tuple[socket.socket, float]] = field(default_factory=list)  # claims waiting for it
    owner: socket.socket | None = None  # the pool process it was handed to
    released: bool = False
    reaped: bool = False

    @property
    def key(self) -> Key:
        return self.ahead.key


def identity(workspace: str, view: ShellView) -> tuple[Any, ...]:
    """What a sandbox of `view` binds, as found at the workspace's path now: the workspace's
    directory and each bound path's (device, inode), or None where it is missing. A sandbox
    whose identity changed (its workspace deleted or replaced, a bound directory renamed or made)
    would show a call what is no longer there, or not what now is: it is not used."""
    st = os.stat(workspace, follow_symlinks=False)
    found: list[Any] = [(st.st_dev, st.st_ino)]
    for relpath in () if view.whole else view.binds:
        try:
            fd = workspace_files.open_beneath(Path(workspace), relpath)
        except OSError:
            fd = None
        except Exception:  # a symlink or a special file now: different, whatever it was
            found.append("refused")
            continue
        if fd is None:
            found.append(None)
            continue
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        found.append((st.st_dev, st.st_ino))
    return tuple(found)


class Slots:
    """The keeper's cgroups, one per sandbox alive, reused after its call: a fresh group costs
    the spawn more than joining one (workers/cgroups.py), and usage is read as deltas."""

    def __init__(self, cgroups: Cgroups | None) -> None:
        self.cgroups = cgroups
        self.free: list[CallGroup] = []
        self.retired: list[CallGroup] = []
        self.names = itertools.count(1)

    def take(self) -> CallGroup | None:
        if self.cgroups is None:
            return None
        if self.free:
            return self.free.pop()
        return self.cgroups.create(f"{group_name(os.getpid())}.k{next(self.names)}")

    def give_back(self, group: CallGroup | None) -> None:
        """After its sandbox is gone: kept for the next, or retired if the call left more page
        cache charged to it than the next call's limit should carry (as Cgroups.renew_if_charged)."""
        if group is None or self.cgroups is None:
            return
        held = charged_bytes(group)
        if held is not None and held > self.cgroups.leftover_bytes:
            self.retired.append(group)
        else:
            self.free.append(group)

    def sweep(self) -> None:
        self.retired = [group for group in self.retired if not remove_now(group)]

    def remove_all(self) -> None:
        for group in self.free + self.retired:
            remove_now(group)


class Offers:
    """The workspaces the keeper holds a sandbox for, marked for the pool processes (prepared.offers_dir)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)  # an earlier keeper's marks
        directory.mkdir(mode=0o700)
        self.counts: collections.Counter[str] = collections.Counter()  # keys held per workspace

    def add(self, workspace: str) -> None:
        self.counts[workspace] += 1
        if self.counts[workspace] == 1:
            (self.directory / offer_name(workspace)).touch()

    def remove(self, workspace: str) -> None:
        self.counts[workspace] -= 1
        if self.counts[workspace] <= 0:
            del self.counts[workspace]
            with contextlib.suppress(FileNotFoundError):
                (self.directory / offer_name(workspace)).unlink()

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class Keeper:
    def __init__(self, settings: Settings, runner: BwrapRunner, listener: socket.socket,
                 client: redis.Redis | None, offers: Offers, parent_fd: int | None = None) -> None:
        self.limit, self.idle_s = settings.prepared_sandboxes, settings.prepared_idle_s
        self.runner, self.listener, self.redis = runner, listener, client
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, ("accept", None))
        if parent_fd is not None:
            self.selector.register(parent_fd, selectors.EVENT_READ, ("parent", None))
        self.ids = itertools.count(1)
        self.held: dict[int, Held] = {}  # every sandbox not reaped and freed yet
        self.ready: dict[Key, Held] = {}  # starting or ready, not claimed: one per key (see _offer)
        self.offers = offers
        self.owned: dict[socket.socket, set[int]] = {}
        self.slots = Slots(runner.cgroups)
        self.revoked: frozenset[str] = frozenset()
        self.revocations_at = 0.0
        self.paused = False
        self.stats: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self.running = True

    # --- the loop ---------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        next_tick = time.monotonic() + TICK_S
        while self.running:
            for key, _ in self.selector.select(max(0.0, next_tick - time.monotonic())):
                kind, what = key.data
                self._guarded(getattr(self, f"_on_{kind}"), what if what is not None else key.fileobj)
            if time.monotonic() >= next_tick:
                self._guarded(lambda _: self._tick(), None)
                next_tick = time.monotonic() + TICK_S
        self.stop()

    def _guarded(self, handler: Any, argument: Any) -> None:
        """A bug in one event's handling is logged, not the keeper's end: every sandbox (a running
        call's too) dies with the keeper."""
        try:
            handler(argument)
        except Exception:  # noqa: BLE001
            log.exception("keeper: an event failed")

    def _on_accept(self, _: object) -> None:
        try:
            conn, _addr = self.listener.accept()
        except OSError:
            return
        if peer_uid(conn) not in (0, os.getuid()):
            conn.close()  # only root and the worker's own processes may ask anything
            return
        conn.setblocking(False)
        self.owned[conn] = set()
        self.selector.register(conn, selectors.EVENT_READ, ("message", conn))

    def _on_parent(self, _: object) -> None:
        self.running = False  # the worker's main process is gone: so is everything it started

    def _on_message(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._closed(conn)
            return
        try:
            message = json.loads(data)
            getattr(self, f"_op_{message['op']}")(conn, message)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("keeper: a malformed request (%s: %s): closing its connection", type(exc).__name__, exc)
            self._closed(conn)

    def _closed(self, conn: socket.socket) -> None:
        """A pool process went (or its connection did): whatever it holds is killed."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        for handed_id in self.owned.pop(conn, set()):
            self._release(handed_id)
        for held in self.ready.values():
            held.waiters = [(waiter, deadline) for waiter, deadline in held.waiters if waiter is not conn]
        conn.close()

    # --- operations ---------------------------------------------------------------------------------

    def _op_prepare(self, conn: socket.socket, message: dict[str, Any]) -> None:
        ahead = Ahead(Key.from_wire(message["key"]), str(message["tenant"]), message.get("jti"),
                      float(message["expires_at"]))
        if self.paused or self.limit <= 0:
            return
        if (held := self.ready.get(ahead.key)) is not None:
            held.ready_since, held.ahead = time.monotonic(), ahead  # still unused: its idle time restarts
            return
        if time.time() >= ahead.expires_at - EXPIRY_MARGIN_S or self._revoked_now(ahead):
            return
        while len(self.ready) >= self.limit:
            self._discard(min(self.ready.values(), key=lambda h: h.ready_since), "made room")
        self._start(ahead)

    def _op_claim(self, conn: socket.socket, message: dict[str, Any]) -> None:
        key = Key.from_wire(message["key"])
        held = None if self.paused else self.ready.get(key)
        usable = held is not None and self._usable(held)
        self._count(key.workspace, hit=usable)
        if held is None or not usable:
            if held is not None:
                self._discard(held, "changed or expired")
            self._answer(conn, {"ok": False})
        elif held.child is None:
            held.waiters.append((conn, time.monotonic() + CLAIM_WAIT_S))  # answered once it is ready
        else:
            self._hand(conn, held)

    def _op_release(self, conn: socket.socket, message: dict[str, Any]) -> None:
        handed_id = int(message["id"])
        if handed_id in self.owned.get(conn, set()):
            self.owned[conn].discard(handed_id)
            self._release(handed_id)

    def _op_forget(self, conn: socket.socket, message: dict[str, Any]) -> None:
        workspace = str(message["workspace"])
        for held in [held for held in self.ready.values() if held.key.workspace == workspace]:
            self._discard(held, "its workspace was deleted or replaced")

    def _op_pause(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """Stop (or start again) preparing and handing over; what is prepared is killed."""
        self.paused = bool(message["on"])
        if self.paused:
            for held in list(self.ready.values()):
                self._discard(held, "the keeper was paused")
        self._answer(conn, {"ok": True, "paused": self.paused})

    def _op_status(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """For operators and tests: what is prepared, and each workspace's hits and misses."""
        ready = [{**held.key.wire(), "ready": held.child is not None, "child": held.child}
                 for held in self.ready.values()]
        self._answer(conn, {"ok": True, "paused": self.paused, "limit": self.limit, "prepared": ready,
                            "claimed": sum(len(ids) for ids in self.owned.values()),
                            "stats": {ws: {"hits": hits, "misses": misses}
                                      for ws, (hits, misses) in self.stats.items()}})

    def _answer(self, conn: socket.socket, reply: dict[str, Any], fds: list[int] | None = None) -> bool:
        try:
            socket.send_fds(conn, [json.dumps(reply).encode()], fds or [])
            return True
        except OSError:
            return False

    def _count(self, workspace: str, hit: bool) -> None:
        counts = self.stats.setdefault(workspace, [0, 0])
        counts[0 if hit else 1] += 1
        self.stats.move_to_end(workspace)
        while len(self.stats) > STATS_KEPT:
            self.stats.popitem(last=False)

    # --- a sandbox's life ---------------------------------------------------------------------------

    def _start(self, ahead: Ahead) -> None:
        """Launch the sandbox a cold call of this key would get, in a group of its own, metered
        from now (its set-up counts, as a cold call's does)."""
        key, group = ahead.key, None
        binds = None
        try:
            group = self.slots.take()
            binds = None if key.view.whole else _open_view(Path(key.workspace), key.view)
            found = identity(key.workspace, key.view)
            meter = usage.start(group) if group is not None else usage.NO_METER
            try:
                launched = self.runner.launch(Path(key.workspace), key.network, binds, group, json_status=True)
            except BaseException:
                meter.stop()
                raise
        except Exception as exc:  # noqa: BLE001 - the call that comes will start its sandbox cold
            log.warning("keeper: cannot prepare a sandbox: %s", exc)
            self.slots.give_back(group)
            return
        finally:
            _close(*(fd for _, fd in binds or ()))
        held = Held(next(self.ids), ahead, launched, group, meter, found, os.pidfd_open(launched.popen.pid))
        self.held[held.id] = held
        self._offer(held)
        os.set_blocking(launched.status, False)
        self.selector.register(launched.status, selectors.EVENT_READ, ("status", held))
        self.selector.register(held.bwrap_pidfd, selectors.EVENT_READ, ("exit", held))

    def _on_status(self, held: Held) -> None:
        """bwrap's first status line: its sandbox's pid. Then it is ready to be claimed."""
        try:
            chunk = os.read(held.launched.status, 4096)
        except BlockingIOError:
            return
        held.status_buffer += chunk
        if chunk and b"\n" not in held.status_buffer:
            return
        self.selector.unregister(held.launched.status)
        try:
            held.child = held.launched.settle(held.status_buffer.partition(b"\n")[0] if chunk else b"")
            held.pidfd = os.pidfd_open(held.child)
            if _parent_of(held.child) != held.launched.popen.pid:
                raise ProcessLookupError("the sandbox's init is gone")
        except Exception as exc:  # noqa: BLE001 - SandboxUnavailable, or a sandbox gone already
            log.warning("keeper: a prepared sandbox did not start: %s", exc)
            self._discard(held, "did not start")
            return
        waiters, held.waiters = held.waiters, []
        for conn, deadline in waiters:
            if held.owner is None and deadline > time.monotonic() and self.ready.get(held.key) is held:
                self._hand(conn, held)
            else:
                self._answer(conn, {"ok": False})

    def _usable(self, held: Held) -> bool:
        """Alive, within its idle time and its token's, and binding what is at its paths now."""
        if held.reaped or held.launched.popen.poll() is not None:
            return False
        if held.pidfd is not None and select.select([held.pidfd], [], [], 0)[0]:
            return False  # its init died: bwrap has not said so yet
        if time.monotonic() - held.ready_since > self.idle_s or time.time() >= held.ahead.expires_at:
            return False
        try:
            return identity(held.key.workspace, held.key.view) == held.identity
        except OSError:
            return False

    def _hand(self, conn: socket.socket, held: Held) -> None:
        """Its pipes, its status, its init's pidfd and its meter, to the pool process that claimed
        it; the keeper keeps only what it needs to kill and reap it. Single use: it leaves `ready`
        first, and a hand-over that fails kills it."""
        self._withdraw(held)
        assert held.child is not None and held.pidfd is not None
        launched = held.launched
        assert launched.popen.stdout is not None and launched.popen.stderr is not None
        started, meter_fds = held.meter.handover()
        fds = [launched.stdin, launched.popen.stdout.fileno(), launched.popen.stderr.fileno(), launched.status,
               held.pidfd, *meter_fds]
        sent = self._answer(conn, {"ok": True, "id": held.id, "child": held.child, "meter": started}, fds)
        _close(launched.stdin, launched.status, *meter_fds)
        launched.stdin = launched.status = -1
        launched.popen.stdout.close()
        launched.popen.stderr.close()
        held.owner = conn
        self.owned.setdefault(conn, set()).add(held.id)
        if not sent:
            log.warning("keeper: a hand-over failed midway: the sandbox is killed")
            self.owned[conn].discard(held.id)
            self._release(held.id)

    def _release(self, handed_id: int) -> None:
        """Its call is over (or its pool process went): killed if it is not gone yet, its group
        given back once bwrap is reaped."""
        held = self.held.get(handed_id)
        if held is None:
            return
        held.released = True
        self._kill(held)
        if held.reaped:
            self._free(held)

    def _discard(self, held: Held, why: str) -> None:
        """Kill a sandbox that will serve no call; its group goes back once bwrap is reaped."""
        log.debug("keeper: prepared sandbox %d dropped: %s", held.id, why)
        if self.ready.get(held.key) is held:
            self._withdraw(held)
        for conn, _ in held.waiters:
            self._answer(conn, {"ok": False})
        held.waiters = []
        held.released = True
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(held.launched.status)
        held.meter.stop()
        self._kill(held)
        _close(held.launched.status)
        held.launched.status = -1
        held.launched.abort()
        if held.reaped:
            self._free(held)

    def _offer(self, held: Held) -> None:
        self.ready[held.key] = held
        self.offers.add(held.key.workspace)

    def _withdraw(self, held: Held) -> None:
        del self.ready[held.key]
        self.offers.remove(held.key.workspace)

    def _kill(self, held: Held) -> None:
        if held.pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(held.pidfd, signal.SIGKILL)
        if not held.reaped:  # before its init has a group of its own, bwrap's group holds it
            kill_tree(held.launched.popen, held.child or held.launched.popen.pid)

    def _on_exit(self, held: Held) -> None:
        """bwrap ended: reaped here (the keeper is its parent); a sandbox not yet claimed is dropped."""
        self.selector.unregister(held.bwrap_pidfd)
        os.close(held.bwrap_pidfd)
        held.launched.popen.wait()
        held.reaped = True
        if held.child is not None:
            orphans.reap(held.child)
        if self.ready.get(held.key) is held:
            self._discard(held, "died")
        elif held.released:
            self._free(held)

    def _free(self, held: Held) -> None:
        """Its tree is gone and its meter read: the group serves the next sandbox."""
        if self.held.pop(held.id, None) is None:
            return
        if held.pidfd is not None:
            os.close(held.pidfd)
        _close(held.launched.status)
        held.launched.status = -1
        held.launched.abort()
        self.slots.give_back(held.group)

    # --- every tick ---------------------------------------------------------------------------------

    def _tick(self) -> None:
        now = time.monotonic()
        orphans.reap_pending()
        self._refresh_revocations()
        for held in list(self.ready.values()):
            for conn, deadline in [waiter for waiter in held.waiters if waiter[1] <= now]:
                self._answer(conn, {"ok": False})  # it is not ready in time: that call starts cold
            held.waiters = [waiter for waiter in held.waiters if waiter[1] > now]
            if held.child is not None and not self._usable(held):
                self._discard(held, "idle too long, its token ended, or its workspace changed")
            elif self._is_revoked(held.ahead):
                self._discard(held, "its token was revoked")
        self.slots.sweep()

    def _refresh_revocations(self) -> None:
        """The live revocations (shared/revocations.py), polled only while a prepared sandbox's
        token could be among them."""
        if self.redis is None or time.monotonic() < self.revocations_at:
            return
        if not any(held.ahead.jti for held in self.ready.values()):
            return
        self.revocations_at = time.monotonic() + REVOCATION_POLL_S
        try:
            found = self.redis.zrangebyscore(keys.REVOCATIONS, time.time(), "+inf")
        except redis.RedisError as exc:
            log.warning("keeper: cannot read revocations (%s): nothing prepared is handed over", exc)
            self.revoked = frozenset({"*"})
            return
        self.revoked = frozenset(entry.decode() for entry in found)

    def _revoked_now(self, ahead: Ahead) -> bool:
        """Asked of Redis itself before a sandbox is started (off any call's path), so none is
        ever started for a revoked token; Redis unreachable counts as revoked."""
        if ahead.jti is None:
            return False
        if self.redis is None:
            return self._is_revoked(ahead)
        try:
            return is_revoked(self.redis, ahead.jti, ahead.tenant)
        except redis.RedisError:
            return True

    def _is_revoked(self, ahead: Ahead) -> bool:
        if ahead.jti is None:
            return False
        if "*" in self.revoked:
            return True
        return ahead.jti in self.revoked or watch_entry(ahead.jti, ahead.tenant) in self.revoked

    def stop(self) -> None:
        """Kill every sandbox, wait for them, remove the groups."""
        for held in list(self.held.values()):
            self._kill(held)
        deadline = time.monotonic() + 5
        for held in list(self.held.values()):
            with contextlib.suppress(Exception):
                held.launched.popen.wait(max(0.1, deadline - time.monotonic()))
            if held.group is not None:
                remove_now(held.group)
        self.slots.remove_all()
        self.offers.remove_all()


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def listen(path: Path) -> socket.socket:
    """The keeper's socket: a path in a 0700 directory, 0600 itself; a stale one is replaced."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_umask)
    listener.listen(64)
    listener.setblocking(False)
    return listener


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.sandbox.keeper")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--parent-fd", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[%(asctime)s: %(levelname)s/keeper] %(message)s")
    settings = Settings.from_env(require_jwt=False)
    let_commands_start_with_default_signals()  # what the worker ignores, its sandboxes must not
    orphans.become_subreaper()  # it reaps its sandboxes' inits (workers/sandbox/orphans.py)
    runner = build_runner(settings)
    if not isinstance(runner, BwrapRunner):
        log.error("keeper: RUNWARDEN_SANDBOX is not bwrap: nothing to prepare")
        return 2
    listener = listen(args.socket)
    keeper = Keeper(settings, runner, listener, connections.connect(settings, socket_timeout=5),
                    Offers(offers_dir(args.socket)), args.parent_fd)

    def stop(signum: int, _frame: object) -> None:
        keeper.running = False
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("keeper: up to %d sandboxes prepared, %ss idle at most, on %s", keeper.limit, keeper.idle_s,
             args.socket)
    try:
        keeper.serve_forever()
    finally:
        with contextlib.suppress(FileNotFoundError):
            args.socket.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())


class KeeperProcess:
    """The worker's main process's handle on its keeper: started once its sandbox's self-test
    passed, started again should it die (the pool runs cold meanwhile), stopped with the worker."""

    START_S = 20.0

    def __init__(self, settings: Settings, path: Path) -> None:
        self.settings, self.path = settings, path
        self.popen: subprocess.Popen[bytes] | None = None
        self._parent_end: int | None = None
        self._stopping = threading.Event()

    def start(self) -> bool:
        """Start it and wait for its socket; False (and nothing left running) if it did not come up."""
        read_end, self._parent_end = os.pipe()
        os.set_inheritable(self._parent_end, False)
        # A session of its own: a SIGTERM to the worker's process group (a warm shutdown) must not
        # end the sandboxes of the calls the pool is finishing; it stops at worker_shutdown.
        self.popen = subprocess.Popen([sys.executable, "-m", "workers.sandbox.keeper", "--socket", str(self.path),
                                       "--parent-fd", str(read_end)], pass_fds=(read_end,), start_new_session=True)
        os.close(read_end)
        deadline = time.monotonic() + self.START_S
        while time.monotonic() < deadline and self.popen.poll() is None:
            if self.path.exists():
                return True
            time.sleep(0.05)
        log.warning("the sandbox keeper did not start: shell calls start their sandboxes cold")
        self._terminate()
        return False

    def supervise(self) -> None:
        """Started again when it dies, as Celery does a pool process (in a thread of the worker)."""
        threading.Thread(target=self._watch, name="runwarden-keeper", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.is_set():
            popen = self.popen
            if popen is not None and popen.poll() is not None and not self._stopping.is_set():
                log.warning("the sandbox keeper exited (%s): starting it again", popen.returncode)
                _close(self._parent_end)
                self._parent_end = None
                self.start()
            self._stopping.wait(1.0)

    def stop(self) -> None:
        self._stopping.set()
        self._terminate()

    def in_pool_process(self) -> None:
        """A pool process, forked from the main one, lets go of the keeper's parent pipe: only the
        main process's end keeps the keeper alive, so the keeper sees that process go."""
        _close(self._parent_end)
        self._parent_end = None
        self._stopping.set()  # nothing to supervise from here

    def _terminate(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        _close(self._parent_end)
        self._parent_end = None
