"""Prepared sandboxes, the pool process's side: claim the sandbox the keeper started ahead of time
for this call's run, grant and network (workers/sandbox/keeper.py), or start one cold.

A prepared sandbox is not a child of the pool process: it arrives as file descriptors over the
keeper's socket (SCM_RIGHTS): the write end of its stdin, the read ends of its stdout and stderr,
bwrap's `--json-status-fd` (which says the command's exit code at the end) and a pidfd of the
sandbox's PID 1 (its init: SIGKILL to it ends everything inside). `HandedProcess` implements the
started process's interface on them, so the shell call cannot tell it from a cold one. The pool
process keeps one connection to the keeper; while it holds a sandbox, that connection is the
sandbox's lease: should the pool process die, the keeper sees the connection close and kills it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

from shared.endings import Usage
from shared.paths import WHOLE_WORKSPACE, ShellView
from shared.settings import Settings
from workers import metrics, usage
from workers.sandbox.base import Ahead, Go, Key, NotStarted, check_cwd, init_has_forked, write_frame
from workers.sandbox.bwrap import BwrapRunner
from workers.sandbox.host import runtime_dir

log = logging.getLogger("runwarden.sandbox")

MAX_MESSAGE = 256 * 1024  # a key's view lists the token's paths (bounded by the token's size)
MAX_FDS = 8
CLAIM_TIMEOUT_S = 2.0  # the keeper answers at once, or when the sandbox it is starting is ready
RECONNECT_S = 1.0  # after the keeper could not be reached: cold spawns meanwhile
HANDED_FDS = 5  # stdin, stdout, stderr, status, the init's pidfd; then the meter's own


def keeper_socket(settings: Settings, worker_pid: int) -> Path:
    """Where the keeper of the worker whose main process is `worker_pid` listens: in the runtime
    directory (root's /run/runwarden, or .runwarden in the workspaces root), which no sandbox binds
    (a sandbox binds /usr, its /etc copy and its run's workspace), in a 0700 directory of its own.
    A path socket, never an abstract one: a `shell:network` sandbox shares the host's network
    namespace, and every abstract socket in it."""
    name = f"{socket.gethostname()}-{worker_pid}.sock"
    return runtime_dir(settings) / "keeper" / name


def offers_dir(socket_path: Path) -> Path:
    """Where the keeper listening on `socket_path` marks each workspace it holds a sandbox for
    (starting or ready), with an empty file named by `offer_name`, beside its socket in the same
    0700 directory. A pool process asks the keeper only for a workspace marked there: a stat,
    where a claim is a round trip through the keeper's socket and loop (~0.4 ms of CPU for the two
    processes, under load), and most calls of a busy run find nothing (none is prepared for them)."""
    return socket_path.with_name(socket_path.stem + ".offers")


def offer_name(workspace: str) -> str:
    return hashlib.sha256(workspace.encode()).hexdigest()[:32]


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end (SO_PEERCRED: pid, uid, gid)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


class HandedProcess:
    """A sandbox the keeper started and handed over, running this call's command."""

    def __init__(self, keeper: "KeeperClient", handed_id: int, child: int, fds: list[int],
                 meter: usage.Meter) -> None:
        self.stdin, self.stdout, self.stderr, self._status, self._pidfd = fds[:HANDED_FDS]
        self.group_leader = child  # the sandbox's init, which leads the command's process group
        self._keeper, self._id, self._meter = keeper, handed_id, meter
        self._code: int | None = None
        self._eof = False
        self._buffer = b""
        self._usage: Usage | None = None
        os.set_blocking(self._status, False)

    def started(self) -> bool:
        """Whether its shell exists: the keeper hands a sandbox over as soon as bwrap has made its
        init, which forks the shell a few ms later, if the call comes that soon."""
        return init_has_forked(self.group_leader)

    def _gone(self) -> bool:
        """Whether the init has exited (a pidfd polls readable then), so its pid names no one."""
        return self._pidfd < 0 or bool(select.select([self._pidfd], [], [], 0)[0])

    def signal(self, signum: int) -> None:
        """To the command's process group, while its init lives (after that, the number could name
        another process group: the pidfd says which it is)."""
        if not self._gone():
            try:
                os.killpg(self.group_leader, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the sandbox's PID 1 through its pidfd: the kernel ends everything inside."""
        if self._pidfd < 0:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def poll(self) -> int | None:
        self._read_status()
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("sandbox", timeout or 0)
            select.select([self._status], [], [], left)
        # bwrap says the exit code once its init is reaped; if bwrap died without saying it (its
        # keeper was killed), the init follows it (PR_SET_PDEATHSIG): wait for that too.
        if self._pidfd >= 0:
            select.select([self._pidfd], [], [], 5 if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._code  # type: ignore[return-value]

    def _read_status(self) -> None:
        """bwrap's --json-status-fd after the child-pid line (read by the keeper): one JSON object
        a line, `{"exit-code": N}` last; EOF without it means bwrap was killed, and its sandbox
        with it."""
        while not self._eof and self._code is None:
            try:
                chunk = os.read(self._status, 4096)
            except BlockingIOError:
                return
            if not chunk:
                self._eof = True
                self._code = 128 + signal.SIGKILL
                return
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                code = _exit_code(line)
                if code is not None:
                    self._code = code

    def ended_by_signal(self) -> bool:
        """bwrap reports a death by signal N as 128 + N, as for a cold sandbox."""
        code = self._code
        return code is not None and 128 < code < 128 + signal.NSIG

    def usage(self) -> Usage:
        if self._usage is None:
            self._usage = self._meter.stop()
        return self._usage

    def close(self) -> None:
        self.usage()
        for fd in (self.stdin, self.stdout, self.stderr, self._status, self._pidfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdin = self.stdout = self.stderr = self._status = self._pidfd = -1
        self._keeper.release(self._id)


def _exit_code(line: bytes) -> int | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    code = value.get("exit-code") if isinstance(value, dict) else None
    return code if isinstance(code, int) else None


class KeeperClient:
    """This pool process's connection to its worker's keeper: claim, prepare, release, forget.

    Every failure (no keeper yet, a keeper restarting, a timeout) makes the call start its sandbox
    cold, and drops the connection: a keeper that sees its peer go kills what it was handing it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offers = offers_dir(path)
        self._sock: socket.socket | None = None
        self._pid = 0
        self._retry_at = 0.0

    def _connected(self) -> socket.socket | None:
        if self._sock is not None and self._pid == os.getpid():
            return self._sock
        self._sock = None  # a connection made before a fork is the parent's
        if time.monotonic() < self._retry_at:
            return None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            sock.settimeout(CLAIM_TIMEOUT_S)
            sock.connect(str(self.path))
            if peer_uid(sock) != os.getuid():  # a keeper is this worker's own uid, never another
                sock.close()
                raise ConnectionRefusedError("the keeper's socket belongs to another uid")
        except OSError:
            self._retry_at = time.monotonic() + RECONNECT_S
            return None
        self._sock, self._pid = sock, os.getpid()
        return sock

    def _drop(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close()
        self._sock = None

    def send(self, message: dict[str, Any]) -> bool:
        sock = self._connected()
        if sock is None:
            return False
        try:
            sock.send(json.dumps(message).encode())
            return True
        except OSError:
            self._drop()
            return False

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]] | None:
        """Send, and read the one answer (with the fds it carries); None on any failure."""
        if not self.send(message):
            return None
        assert self._sock is not None
        fds: list[int] = []
        try:
            data, fds, flags, _ = socket.recv_fds(self._sock, MAX_MESSAGE, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
            if not data or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                raise ConnectionError("the keeper's answer was cut")
            return json.loads(data), fds
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            self._drop()
            return None

    def may_have(self, workspace: str) -> bool:
        """Whether the keeper marks a sandbox for `workspace` (offers_dir): only then is it asked."""
        return os.path.exists(self.offers / offer_name(workspace))

    def claim(self, key: Key) -> HandedProcess | None:
        if not self.may_have(key.workspace):
            return None
        answer = self.request({"op": "claim", "key": key.wire()})
        if answer is None:
            return None
        reply, fds = answer
        if not reply.get("ok") or len(fds) < HANDED_FDS:
            for fd in fds:
                os.close(fd)
            return None
        meter = usage.resume(reply.get("meter", {"kind": "none"}), fds[HANDED_FDS:])
        return HandedProcess(self, int(reply["id"]), int(reply["child"]), fds[:HANDED_FDS], meter)

    def prepare(self, ahead: Ahead) -> None:
        self.send({"op": "prepare", "key": ahead.key.wire(), "tenant": ahead.tenant, "jti": ahead.jti,
                   "expires_at": ahead.expires_at})

    def release(self, handed_id: int) -> None:
        self.send({"op": "release", "id": handed_id})

    def forget(self, workspace: Path) -> None:
        self.send({"op": "forget", "workspace": str(workspace)})


class PreparedRunner:
    """bwrap, with the run's next sandbox prepared by the keeper while its agent thinks: a call
    whose sandbox is ready takes it (the keeper checked it is this call's key, alive, and that the
    workspace it binds is still the one at its path), any other starts one cold, as before."""

    name = "bwrap"

    def __init__(self, cold: BwrapRunner, keeper: KeeperClient) -> None:
        self.cold = cold
        self.keeper = keeper

    @property
    def host_uid(self) -> int | None:
        return self.cold.host_uid

    @property
    def cgroups(self):  # type: ignore[no-untyped-def]
        return self.cold.cgroups

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool,
              view: ShellView = WHOLE_WORKSPACE, go: Go | None = None, new_run: bool = False) -> "HandedProcess | Any":
        check_cwd(view, cwd)
        handed = None if new_run else self.keeper.claim(Key(str(workspace), network, view))
        if handed is None:
            metrics.sandbox_started("cold")
            return self.cold.spawn(command, workspace, cwd, network, view, go)
        metrics.sandbox_started("prepared")
        try:
            if go is not None and not go():
                raise NotStarted()
        except BaseException:
            handed.kill()  # single use: killed, never given back
            handed.wait(5)
            handed.close()
            raise
        stdin, handed.stdin = handed.stdin, -1
        write_frame(stdin, cwd, command)
        return handed

    def after_call(self) -> None:
        self.cold.after_call()

    def prepare(self, ahead: Ahead) -> None:
        self.keeper.prepare(ahead)

    def forget(self, workspace: Path) -> None:
        self.keeper.forget(workspace)
