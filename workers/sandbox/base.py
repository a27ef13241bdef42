"""What every runner shares: the started process as an interface, the command's environment and
limits, and the shell a sandbox starts its command with.

A runner starts a command and hands back a `Process`: its two output pipes, how to signal and end
its whole tree, its exit status, and what the tree used (workers/usage.py). A sandbox bwrap spawns
from the pool process itself (workers/sandbox/bwrap.py), a prepared one handed over by the keeper
(workers/sandbox/prepared.py) and an unsandboxed command (workers/sandbox/unsafe.py) all implement
it, so the shell call (workers/shell.py) does not know which one it runs.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import _signal
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from shared.endings import UNMEASURED, Usage
from shared.errors import PathForbidden
from shared.paths import WHOLE_WORKSPACE, ShellView
from shared.settings import Settings
from workers.cgroups import Cgroups
from workers.sandbox import orphans
from workers.usage import NO_METER, Meter, start

SANDBOX_HOME = "/workspace"
REAP_WAIT_S = 1.0  # for an init still exiting, after a call (workers/sandbox/orphans.py)
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
SANDBOX_UID = 1000


def environment() -> dict[str, str]:
    """The command's whole environment: nothing of the worker's."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": SANDBOX_HOME,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "USER": "sandbox",
        "SHELL": "/bin/bash",
        "TMPDIR": "/tmp",
    }


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    processes: int
    file_bytes: int
    open_files: int

    @classmethod
    def from_settings(cls, settings: Settings) -> "Limits":
        return cls(settings.sandbox_memory_bytes, settings.sandbox_max_processes,
                   settings.sandbox_max_file_bytes, settings.sandbox_max_open_files)


class Process(Protocol):
    """A started command, whoever started it."""

    stdout: int  # the read end of its stdout pipe
    stderr: int

    def started(self) -> bool:
        """Whether the command's process exists, so that a signal to its group reaches it."""

    def signal(self, signum: int) -> None:
        """Deliver to the command's process group."""

    def kill(self) -> None:
        """SIGKILL the whole tree."""

    def poll(self) -> int | None:
        """The exit code once it has ended (128 + N for a death by signal N), else None."""

    def wait(self, timeout: float | None = None) -> int:
        """Block until it has ended (subprocess.TimeoutExpired after `timeout` s); its exit code."""

    def ended_by_signal(self) -> bool:
        """Whether the command (once waited for) died of a signal rather than by exiting."""

    def usage(self) -> Usage:
        """What the tree used, once it is gone (read once)."""

    def close(self) -> None:
        """Let go of its pipes and of what it held; the tree must be gone (kill, wait) first."""


@dataclass(frozen=True)
class Key:
    """What a sandbox is made for, beyond its command: the run's workspace, whether it has the
    network, and the view of the workspace the token's allowed_paths give. A sandbox prepared for
    one key is only ever handed to a call with the same key."""

    workspace: str
    network: bool
    view: ShellView

    def wire(self) -> dict[str, object]:
        view = self.view
        return {"workspace": self.workspace, "network": self.network,
                "view": {"whole": view.whole, "make": list(view.make), "binds": list(view.binds)}}

    @classmethod
    def from_wire(cls, data: dict[str, object]) -> "Key":
        view = data["view"]
        if not isinstance(view, dict) or not isinstance(data["workspace"], str):
            raise ValueError("malformed key")
        return cls(data["workspace"], data["network"] is True,
                   ShellView(view["whole"] is True, tuple(map(str, view["make"])), tuple(map(str, view["binds"]))))


@dataclass(frozen=True)
class Ahead:
    """A run's next sandbox, asked for once one of its calls has ended: for its key, and no longer
    than its token is good for (`expires_at`, its exp; its jti, should it be revoked)."""

    key: Key
    tenant: str
    jti: str | None
    expires_at: float


class NotStarted(Exception):
    """The call's go-ahead (a runner's `go`) said no: its sandbox was stopped before its command."""


Go = Callable[[], bool]  # a call's go-ahead: asked once its sandbox is on its way, before its command


class Runner(Protocol):
    name: str

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool,
              view: ShellView = WHOLE_WORKSPACE, go: Go | None = None, new_run: bool = False) -> Process:
        """Start `command`. `go`, if given, is asked once the sandbox is on its way and before the
        command is handed to it, so what it waits for (the call's start in Redis) overlaps the
        sandbox's set-up; if it says no, nothing of the command runs and NotStarted is raised.
        `new_run`: the call is its run's first (its workspace was just made), so nothing can have
        been prepared for it."""

    def after_call(self) -> None:
        """Work for between calls, once a call has answered (its cgroup's upkeep)."""

    def prepare(self, ahead: Ahead) -> None:
        """Start the run's next sandbox ahead of its call, where the runner can."""

    def forget(self, workspace: Path) -> None:
        """A workspace was deleted or replaced: nothing prepared for it may serve a call."""



class ColdRunner:
    """What a runner that starts each command when its call comes (bwrap, unsafe) does between
    calls: the pool process's per-call cgroup, metered and renewed; nothing prepared, nothing kept."""

    cgroups: Cgroups | None

    def meter(self) -> Meter:
        return start(self.cgroups.for_this_process()) if self.cgroups else NO_METER

    def after_call(self) -> None:
        orphans.reap_pending(wait_s=REAP_WAIT_S)
        if self.cgroups:
            self.cgroups.renew_if_charged()

    def prepare(self, ahead: Ahead) -> None:
        """Nothing ahead of time: this runner starts each sandbox when its call comes."""

    def forget(self, workspace: Path) -> None:
        """Nothing kept between calls."""

def check_cwd(view: ShellView, cwd: str) -> None:
    """The API checks cwd against allowed_paths; checked again here, where the view is built."""
    if not view.covers(cwd):
        raise PathForbidden("The cwd is outside what the token's allowed_paths show the shell.")


# Signals a Celery pool child may ignore (it ignores SIGINT). exec keeps an ignored signal ignored,
# and bash cannot even trap a signal ignored on entry; a caught one is reset to default by exec.
_RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                  signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


def _swallow(signum: int, frame: object) -> None:
    """Ignores a signal like SIG_IGN does, but as a handler, which exec resets to the default."""


def let_commands_start_with_default_signals() -> None:
    """Swap this process's SIG_IGN dispositions for a do-nothing handler, so every command spawned
    from it starts with default signal dispositions without code between fork and exec. (The signal
    mask is inherited as it is: Celery's pool processes block nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; pool processes spawn from it
    for signum in _RESET_SIGNALS:
        if _signal.getsignal(signum) == _signal.SIG_IGN:  # `_signal`: no enum made per signal per spawn
            signal.signal(signum, _swallow)


def ulimits(limits: Limits, processes: int, address_space: int | None = None) -> str:
    """Shell that sets the rlimits, hard and soft, or exits 126. Values above this process's hard
    limits are lowered to them: ulimit could not raise those. `address_space` (RLIMIT_AS, per
    process) defaults to the memory limit."""
    def capped(resource_id: int, value: int) -> int:
        hard = resource.getrlimit(resource_id)[1]
        return value if hard == resource.RLIM_INFINITY else min(value, hard)
    memory_kib = capped(resource.RLIMIT_AS, address_space or limits.memory_bytes) // 1024
    file_kib = capped(resource.RLIMIT_FSIZE, limits.file_bytes) // 1024  # bash counts -f in 1024-byte blocks
    nproc = capped(resource.RLIMIT_NPROC, processes)
    nofile = capped(resource.RLIMIT_NOFILE, limits.open_files)
    return f"ulimit -H -S -v {memory_kib} -u {nproc} -f {file_kib} -n {nofile} -c 0 || exit 126; "


def limits_prelude(limits: Limits, processes: int, address_space: int | None = None) -> str:
    """The script of an unsandboxed command's first bash: set the rlimits, then become the
    command's own `bash -c` (so $0, line numbers and error messages are a plain `bash -c`'s)."""
    return ulimits(limits, processes, address_space) + 'exec /bin/bash -c "$1"'


# With a cgroup bounding the tree, its limits are the ones a call meets (passing the memory limit is
# an OOM kill the result names), and the rlimits only back them up: RLIMIT_NPROC counts every
# process of the sandbox's uid, and RLIMIT_AS one process's address space, which programs reserve
# far beyond what they touch (at the memory limit itself, a 200 MB allocation failed as
# MemoryError in a 64 MiB sandbox instead of reaching the cgroup). Still bounded, should a cgroup
# not hold.
NPROC_BACKSTOP = 64
ADDRESS_SPACE_BACKSTOP = 4


def backstop_ulimits(limits: Limits, bounded_by_cgroup: bool) -> str:
    """The rlimits: the limits themselves without a cgroup, a backstop behind one."""
    if not bounded_by_cgroup:
        return ulimits(limits, limits.processes)
    return ulimits(limits, limits.processes * NPROC_BACKSTOP, limits.memory_bytes * ADDRESS_SPACE_BACKSTOP)


def backstop_prelude(limits: Limits, bounded_by_cgroup: bool) -> str:
    """The rlimits prelude of an unsandboxed command (see backstop_ulimits)."""
    return backstop_ulimits(limits, bounded_by_cgroup) + 'exec /bin/bash -c "$1"'


# The sandbox's one bash, after its limits: it reads the call's cwd and command from its stdin, a
# pipe, as `<cwd bytes> <command bytes>\n<cwd><command>` (`LC_ALL=C read -N` counts bytes and reads
# a pipe in blocks; `read -d ''` reads it a byte at a time: +5 ms for 20 KB), gives the command a
# stdin of /dev/null as before, enters the cwd and runs the command in itself. One bash: the
# command used to be handed to a second `bash -c` by exec, which cost ~1 ms more per call; a
# sandbox started ahead of time (workers/sandbox/prepared.py) waits here for its command. What the
# command may notice: $0 is /bin/bash and $LINENO counts from 1 as under `bash -c`, a syntax
# error says "eval: line N", and BASH_EXECUTION_STRING holds this script.
COMMAND_READER = (
    "IFS=' ' read -r __rw_w __rw_c || exit 125; LC_ALL=C IFS= read -r -N \"$__rw_w\" __rw_d || exit 125; "
    "LC_ALL=C IFS= read -r -N \"$__rw_c\" __rw_x || exit 125; exec 0</dev/null; "
    "if [ -n \"$__rw_d\" ]; then cd -P -- \"$__rw_d\" || exit 1; unset -v OLDPWD; fi; "
    "eval \"unset -v __rw_w __rw_c __rw_d __rw_x; $__rw_x\""
)


def frame(cwd: str, command: str) -> bytes:
    """What COMMAND_READER reads: a cwd relative to /workspace ("" for itself) and the command."""
    where, what = cwd.encode(), command.encode()
    return b"%d %d\n" % (len(where), len(what)) + where + what


def write_frame(fd: int, cwd: str, command: str) -> None:
    """Hand the command to a sandbox's reader through its stdin pipe, then close the pipe. The pipe
    is grown first so the write does not wait for the sandbox (1 MiB is Linux's default
    pipe-max-size). A sandbox that is gone already (EPIPE) shows it in its exit status."""
    data = frame(cwd, command)
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


class PopenProcess:
    """A command this process started itself (subprocess): bwrap, or an unsandboxed bash."""

    def __init__(self, popen: subprocess.Popen[bytes], group_leader: int, meter: Meter = NO_METER, *,
                 sandbox_init: bool = False) -> None:
        assert popen.stdout is not None and popen.stderr is not None
        self.popen = popen
        self.group_leader = group_leader
        self.sandbox_init = sandbox_init  # the leader is bwrap's init, and the command will be its child
        self.stdout, self.stderr = popen.stdout.fileno(), popen.stderr.fileno()
        self._meter: Meter | None = meter
        self._usage = UNMEASURED

    def started(self) -> bool:
        """Until bwrap's init has forked the command, the group holds the init alone (which
        ignores what it has no handler for), or does not exist yet."""
        return not self.sandbox_init or init_has_forked(self.group_leader)

    def ended_by_signal(self) -> bool:
        """Unsandboxed, the wait status says so. bubblewrap reports a command's death by signal N
        as its own exit with 128 + N, as shells do, so for a sandbox only that code is left to go
        by: a command that itself runs `exit 137` cannot be told from one killed by SIGKILL."""
        code = self.popen.returncode
        if not self.sandbox_init:
            return code < 0
        return 128 < code < 128 + signal.NSIG

    def signal(self, signum: int) -> None:
        """Deliver to the command's process group (the sandbox init ignores what it has no use for)."""
        try:
            os.killpg(self.group_leader, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the group; for bwrap the group leader is the PID-namespace init, so all inside die.

        Until bwrap has set the sandbox up (a few ms after spawn returns), that init has no group
        of its own yet and is still in bwrap's, so that group is killed first: a kill landing then
        used to kill bwrap alone and leave the sandbox running. Either way the init is hit, as
        killpg and setsid are serialized by the kernel. (bwrap's pid is only used while it is
        unreaped, so it cannot name another process by then.)
        """
        kill_tree(self.popen, self.group_leader)

    def poll(self) -> int | None:
        code = self.popen.poll()
        return None if code is None else _shell_code(code)

    def wait(self, timeout: float | None = None) -> int:
        return _shell_code(self.popen.wait(timeout))

    def usage(self) -> Usage:
        if self._meter is not None:
            self._usage, self._meter = self._meter.stop(), None
        return self._usage

    def close(self) -> None:
        self.usage()  # lets go of what the meter holds open
        for pipe in (self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()
        if self.sandbox_init and self.popen.returncode is not None:
            orphans.reap(self.group_leader)


def init_has_forked(init: int) -> bool:
    """Whether bwrap's init has forked the sandbox's shell yet: until then a signal to its group
    reaches the init alone, which ignores what it has no handler for."""
    try:
        return bool(Path(f"/proc/{init}/task/{init}/children").read_text().strip())
    except OSError:
        return True  # the init is gone, or this kernel has no such file: send, as before


def kill_tree(popen: subprocess.Popen[bytes], group_leader: int) -> None:
    """SIGKILL bwrap's process group while bwrap is unreaped (its pid cannot name another), the
    group `group_leader` leads, and bwrap itself (see PopenProcess.kill)."""
    bwrap_group = [popen.pid] if popen.returncode is None else []
    for group in dict.fromkeys([*bwrap_group, group_leader]):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        popen.kill()
    except ProcessLookupError:
        pass


def _shell_code(code: int) -> int:
    """subprocess reports a death by signal N as -N; shells (and bwrap) as 128 + N."""
    return 128 - code if code < 0 else code
