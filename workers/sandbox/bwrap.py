"""The bubblewrap runner: a fresh sandbox per command, spawned by the pool process itself.

The sandbox gets fresh user, PID, IPC, UTS, cgroup and network namespaces, the system's programs
read-only, the workspace read-write at /workspace (or only the paths the token grants), a private
/tmp, an environment built from nothing, and no capabilities. When the worker runs as root it
first drops to an unprivileged uid, so the sandbox's user is not host root even outside its
namespace. The sandbox's PID 1 is bwrap's init: killing it makes the kernel end every process
inside, including ones that called `setsid` or `nohup`, so no process outlives its call.

Spawning is on the hot path of every shell call, so nothing runs in Python between fork and exec
(a `preexec_fn` forces a full fork() of the ~70 MB pool process: +8 ms a call, measured in bench/);
subprocess then uses vfork. What used to run there moved: the rlimits are set by the sandbox's
one bash, which then reads the command from its stdin and runs it (base.COMMAND_READER), the
sandbox is born in its cgroup (cgroup v1: the spawning thread steps into it around the spawn) or
moved into it while bwrap waits on `--block-fd` (v2), and the uid drop is made by the spawning
thread alone around the spawn (thread_uid.py; `setpriv`'s exec where that cannot be).
(Setting the rlimits from here instead, around the spawn, would need CAP_SYS_RESOURCE to raise the
pool process's own hard limits back, which root lacks in some VMs and containers, this one included.)
"""
from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shlex
import shutil
import subprocess
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from shared.errors import SandboxUnavailable
from shared.paths import WHOLE_WORKSPACE, ShellView
from workers import usage
from workers import workspace as workspace_files
from workers.cgroups import CallGroup, Cgroups
from workers.sandbox import orphans
from workers.sandbox.thread_uid import ThreadUid
from workers.sandbox.base import (COMMAND_READER, ColdRunner, Go, kill_tree, Limits, NotStarted, PopenProcess,
                                  SANDBOX_HOME, SANDBOX_UID, backstop_ulimits, check_cwd, environment,
                                  let_commands_start_with_default_signals, write_frame)

_SYSTEM_DIRS = ("/usr", "/opt/conda")  # read-only; /bin, /lib… are symlinks into /usr on merged-usr systems
_LIVE_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts")  # bound live, over placeholders, for shell:network


class BwrapRunner(ColdRunner):
    name = "bwrap"

    def __init__(self, bwrap: str, limits: Limits, host_uid: int | None, etc_dir: Path,
                 cgroups: Cgroups | None = None, features: frozenset[str] = frozenset(),
                 setpriv: str | None = None, thread_uid: ThreadUid | None = None) -> None:
        self.bwrap = bwrap
        self.features = features
        self.limits = limits
        self.cgroups = cgroups
        self.host_uid = host_uid  # the unprivileged uid to become when the worker is root
        self.thread_uid = thread_uid  # that drop made by the spawning thread alone (thread_uid.py)
        self.setpriv = setpriv  # else util-linux setpriv, which makes it an exec instead of a fork
        # setpriv execs its argv as given, so the sandbox's /proc/1/cmdline shows bwrap's path,
        # unless bwrap is on the default search path (a distribution's /usr/bin/bwrap).
        on_default_path = shutil.which("bwrap", path=os.confstr("CS_PATH")) == bwrap
        self._setpriv_bwrap = "bwrap" if on_default_path else bwrap
        self.etc_dir = etc_dir
        self._binds_by_fd = "--bind-fd" in features
        # The options every sandbox shares, before and after its own, encoded once for the --args memfd.
        self._system = _nul_joined(self._system_options())
        self._environment = _nul_joined(["--chdir", SANDBOX_HOME, "--clearenv",
                                         *(arg for item in environment().items() for arg in ("--setenv", *item))])
        self._limits = backstop_ulimits(limits, cgroups is not None)
        self._setpriv_ids = _names_for(host_uid) if host_uid is not None else ("", "")

    def _system_options(self) -> list[str]:
        """The options every sandbox shares: namespaces, the system read-only, /etc as one directory."""
        args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
        if "--disable-userns" in self.features:
            args.append("--disable-userns")  # the command cannot create nested namespaces
        for path in _SYSTEM_DIRS:
            if os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            target = f"/{name}"
            if os.path.islink(target):
                args += ["--symlink", os.readlink(target), target]
        # One bind for all of /etc: bwrap spends ~0.3 ms on each mount, and 15 files cost 5 ms.
        args += ["--ro-bind", str(self.etc_dir), "/etc"]
        tmp_size = ["--size", str(self.limits.file_bytes)] if "--size" in self.features else []
        # /run is a directory of the sandbox's own root tmpfs: as private as a tmpfs of its own, one mount fewer.
        return args + ["--proc", "/proc", "--dev", "/dev", *tmp_size, "--tmpfs", "/tmp", "--dir", "/run"]

    def options(self, workspace: Path, network: bool, info_fd: int, block_fd: int | None = None,
                binds: list[tuple[str, int]] | None = None, status_option: str = "--info-fd") -> bytes:
        """bwrap's options, as its `--args` memfd holds them (each ends with a NUL). `binds`: (path
        in the workspace, fd opened on it) of a partial view; None: all of it. The command is not in
        them: the sandbox's bash reads it from its stdin (base.frame)."""
        args = [status_option, str(info_fd)]
        if block_fd is not None:
            args += ["--block-fd", str(block_fd)]  # set up, then wait for us before starting the command
        if network:
            args.append("--share-net")
            for path in _LIVE_NETWORK_FILES:
                if os.path.exists(path):
                    args += ["--ro-bind", path, path]  # over the placeholders build_etc left
        args += self._workspace_options(workspace, binds)
        return self._system + _nul_joined(args) + self._environment

    def command(self, binds: list[tuple[str, int]] | None = None) -> list[str]:
        """What bwrap runs in the sandbox: its one bash, which sets the limits and reads the command."""
        checks = "" if binds is None or self._binds_by_fd else _fd_checks(binds)
        return ["/bin/bash", "-c", self._limits + checks + COMMAND_READER, "/bin/bash"]

    def _workspace_options(self, workspace: Path, binds: list[tuple[str, int]] | None) -> list[str]:
        """The whole workspace (one mount: the `**` grant stays as cheap as it was), or only the
        granted paths, bound into an empty tmpfs that is then made read-only.

        Each granted path is bound from the fd opened on it without following a symlink, never
        from its name: the workspace is the agent's, and a concurrent call may swap a directory
        for a symlink to `/` between our check and bwrap's mount. bwrap ≥ 0.10 binds an fd itself
        (`--bind-fd`: it mounts the fd's path, then checks the mount is the fd's inode and dies
        if not). An older bwrap gets `/proc/self/fd/N`, which it resolves to a name, so the
        sandbox's first bash makes the same check before the command starts (see _fd_checks).
        """
        if binds is None:
            return ["--bind", str(workspace), SANDBOX_HOME]
        args = ["--tmpfs", SANDBOX_HOME]
        for relpath, fd in binds:
            source = ["--bind-fd", str(fd)] if self._binds_by_fd else ["--bind", f"/proc/self/fd/{fd}"]
            args += [*source, f"{SANDBOX_HOME}/{relpath}"]
        return args + (["--remount-ro", SANDBOX_HOME] if "--remount-ro" in self.features else [])

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool,
              view: ShellView = WHOLE_WORKSPACE, go: Go | None = None, new_run: bool = False) -> PopenProcess:
        check_cwd(view, cwd)
        binds = None if view.whole else _open_view(workspace, view)
        meter = self.meter()
        try:
            process, stdin = self._spawn(workspace, network, binds, meter, go)
        except BaseException:
            meter.stop()  # lets go of what it holds open
            raise
        finally:
            _close(*(fd for _, fd in binds or ()))
        write_frame(stdin, cwd, command)
        return process

    def _spawn(self, workspace: Path, network: bool, binds: list[tuple[str, int]] | None,
               meter: usage.Meter = usage.NO_METER, go: Go | None = None) -> tuple[PopenProcess, int]:
        """The sandbox, started and waiting for its command, and the write end of its stdin; `go`
        is asked while bwrap sets it up (NotStarted, and the sandbox stopped, if it says no)."""
        launched = self.launch(workspace, network, binds, self.cgroups.for_this_process() if self.cgroups else None)
        try:
            going = go() if go is not None else True
            info = _read_all(launched.status)
        except BaseException:
            launched.stop(launched.popen.pid)
            raise
        finally:
            os.close(launched.status)
        child = launched.settle(info)
        if not going:
            launched.stop(child)
            raise NotStarted()
        return PopenProcess(launched.popen, child, meter, sandbox_init=True), launched.stdin

    def launch(self, workspace: Path, network: bool, binds: list[tuple[str, int]] | None,
               cgroup: CallGroup | None, *, json_status: bool = False) -> "Launched":
        """Start bwrap, in `cgroup`, without waiting for it: its child's pid comes on `status`
        (`--info-fd`, or `--json-status-fd`, which also gives the exit code at the end, for a
        sandbox whose parent is not the one that waits for it), then `Launched.settle`."""
        let_commands_start_with_default_signals()
        orphans.reap_pending()  # inits that were still exiting when their call let go of them
        born_inside = cgroup is not None and cgroup.spawns_inside
        info_read, info_write = os.pipe2(os.O_CLOEXEC)
        # Where the sandbox cannot be born in its cgroup, bwrap waits on --block-fd until it is moved in.
        block_read, block_write = os.pipe2(os.O_CLOEXEC) if cgroup and not born_inside else (None, None)
        # bwrap's options travel through a memfd (`--args`), so the sandbox's /proc/1/cmdline does not
        # show host paths such as the workspaces root.
        options = os.memfd_create("bwrap-args", os.MFD_CLOEXEC)
        os.write(options, self.options(workspace, network, info_write, block_read, binds,
                                       "--json-status-fd" if json_status else "--info-fd"))
        os.lseek(options, 0, os.SEEK_SET)
        stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
        popen = None
        try:
            with cgroup.joined_by_this_thread() if cgroup and born_inside else contextlib.nullcontext():
                popen = self._popen(["--", *self.command(binds)], options, stdin_read,
                                    [info_write, options, block_read, *(fd for _, fd in binds or ())])
        except BaseException:
            if popen is not None:  # started, but this thread could not leave the call's cgroup
                kill_tree(popen, popen.pid)  # bwrap's group: its child is still in it
                popen.wait()
            _close(info_read, block_write, stdin_write)
            raise
        finally:
            _close(info_write, options, block_read, stdin_read)
        return Launched(popen, info_read, stdin_write, cgroup if block_write is not None else None, block_write)

    def _popen(self, command: list[str], options: int, stdin: int, fds: list[int | None]) -> subprocess.Popen[bytes]:
        """Start bwrap (as the unprivileged uid when we are root: by this thread alone, else through
        setpriv); no preexec_fn, so subprocess can vfork."""
        bwrap = ["bwrap", "--args", str(options), *command]
        executable, drop = self.bwrap, dict[str, Any]()
        if self.host_uid is not None and self.thread_uid is not None:
            with self.thread_uid.become():
                return self._start(bwrap, executable, stdin, fds, drop)
        if self.host_uid is not None and self.setpriv:
            user, group = self._setpriv_ids
            bwrap = [self.setpriv, "--reuid", user, "--regid", group, "--clear-groups", "--", self._setpriv_bwrap,
                     *bwrap[1:]]
            executable = self.setpriv
        elif self.host_uid is not None:  # no setpriv: the same drop, by subprocess, at the price of a fork
            drop = {"user": self.host_uid, "group": self.host_uid, "extra_groups": []}
        return self._start(bwrap, executable, stdin, fds, drop)

    @staticmethod
    def _start(argv: list[str], executable: str, stdin: int, fds: list[int | None],
               drop: dict[str, Any]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv, executable=executable, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={},  # bwrap itself starts clean: the sandbox's /proc/1/environ is empty too
            pass_fds=tuple(fd for fd in fds if fd is not None), start_new_session=True, **drop,
        )



@dataclass
class Launched:
    """A bwrap just started (BwrapRunner.launch): it sets the sandbox up, whose shell then waits
    for its command on `stdin` (base.write_frame)."""

    popen: subprocess.Popen[bytes]
    status: int  # the read end of its --info-fd or --json-status-fd
    stdin: int  # the write end of the sandbox's stdin
    move_into: CallGroup | None  # the group to move its child into, while it waits on --block-fd
    block: int | None  # the write end of that --block-fd

    def settle(self, info: bytes) -> int:
        """The sandbox's child pid from bwrap's first status message, moved into its group if it
        waits for that; SandboxUnavailable (and nothing left running) if bwrap did not start it."""
        try:
            child = int(json.loads(info)["child-pid"])
        except (ValueError, KeyError, TypeError):
            self.abort()
            stderr = self.popen.communicate(timeout=5)[1].decode(errors="replace")[-500:]
            raise SandboxUnavailable(f"bubblewrap did not start: {stderr.strip() or 'no reason given'}") from None
        if self.move_into is not None and self.block is not None:
            try:
                self.move_into.add(child)  # bwrap's sandbox child, before it starts anything
            except OSError as exc:
                self.stop(child)  # never let it run unbounded: bwrap reads EOF as "go" too
                raise SandboxUnavailable(f"cannot move the sandbox into its cgroup: {exc}") from None
            finally:
                _close(self.block)
                self.block = None
        return child

    def stop(self, child: int) -> None:
        """Kill it (bwrap, and the sandbox whose init is `child`, or bwrap's pid while that is not
        known: its group holds the init until the sandbox has its own), reap it, let go of it."""
        kill_tree(self.popen, child)
        self.popen.wait()
        if child != self.popen.pid:
            orphans.reap(child)
        self.abort()

    def abort(self) -> None:
        """Let go of what the spawner holds of it (its stdin, its --block-fd); bwrap's pipes too,
        once it is reaped. Once only: each fd is forgotten as it is closed."""
        _close(self.stdin, self.block)
        self.stdin, self.block = -1, None
        for pipe in (self.popen.stdout, self.popen.stderr):
            if pipe is not None and self.popen.returncode is not None:
                pipe.close()


def _names_for(uid: int) -> tuple[str, str]:
    """What setpriv is given for the uid and its gid: their names where /etc/passwd and /etc/group
    have them. setpriv looks its arguments up as names first, and a number is a lookup that misses
    in `files` and goes on to the next NSS module (libnss_systemd here: ~0.7 ms of every spawn)."""
    try:
        user = pwd.getpwuid(uid).pw_name
        group = grp.getgrgid(uid).gr_name
    except KeyError:
        return str(uid), str(uid)
    try:
        same = pwd.getpwnam(user).pw_uid == uid and grp.getgrnam(group).gr_gid == uid
    except KeyError:
        same = False
    return (user, group) if same and not user.isdigit() and not group.isdigit() else (str(uid), str(uid))


def _open_view(workspace: Path, view: ShellView) -> list[tuple[str, int]]:
    """Make the granted directories that are missing, then open what is to be bound (a granted
    path that does not exist is left out); a symlink on the way refuses the call."""
    binds: list[tuple[str, int]] = []
    try:
        for relpath in view.make:
            workspace_files.make_dirs(workspace, relpath)
        for relpath in view.binds:
            fd = workspace_files.open_beneath(workspace, relpath)
            if fd is not None:
                binds.append((relpath, fd))
    except BaseException:
        _close(*(fd for _, fd in binds))
        raise
    return binds


def _fd_checks(binds: list[tuple[str, int]]) -> str:
    """For a bwrap without --bind-fd: the sandbox's first bash checks that each mount is the file
    the worker opened (`-ef`: same device and inode), and closes that fd, which bwrap passes on
    and which leads out of the sandbox, before anything of the command runs."""
    checks = []
    for relpath, fd in binds:
        mount = shlex.quote(f"{SANDBOX_HOME}/{relpath}")
        checks.append(f"if [ {mount} -ef /proc/self/fd/{fd} ]; then exec {fd}<&-; else "
                      "echo 'runwarden: the workspace changed while the sandbox started; run again' >&2; "
                      "exit 125; fi; ")
    return "".join(checks)


def _nul_joined(args: list[str]) -> bytes:
    return b"".join(arg.encode() + b"\0" for arg in args)


def _close(*fds: int | None) -> None:
    """Close the fds given; None, or -1 for one handed on already, is skipped."""
    for fd in fds:
        if fd is not None and fd >= 0:
            os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
        if chunk.rstrip().endswith(b"}"):
            break
    return b"".join(chunks)


