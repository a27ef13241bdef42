"""Per-call cgroups: a pids and a memory limit for one sandboxed command and everything it starts,
and what the call's tree used (workers/usage.py reads it: memory, cpu time, OOM kills).

RLIMIT_NPROC counts every process of a uid, so with rlimits alone one call's fork bomb starves
every other call running as the same uid; RLIMIT_AS bounds one process, not a tree. A cgroup per
call bounds the whole tree, and its memory limit is the one a call meets: passing it is a kernel
OOM kill, which the call's result can name. It needs a worker allowed to create cgroups (root on
the host, or a delegated subtree); otherwise the worker logs it and keeps the rlimits only. On
cgroup v1 a cpuacct group is added where that hierarchy is writable, for the cpu time.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("runwarden.cgroups")

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP = "runwarden"


@dataclass(frozen=True)
class CallGroup:
    """The cgroup directories of one call (one per v1 hierarchy, or one v2 directory)."""

    dirs: tuple[Path, ...]
    homes: tuple[Path, ...] = ()  # v1: this process's own groups, to come back to after a spawn
    kinds: tuple[tuple[str, Path], ...] = ()  # (hierarchy: "pids", "memory", "cpuacct" or "v2", its directory)

    def directory(self, kind: str) -> Path | None:
        return dict(self.kinds).get(kind)

    @property
    def spawns_inside(self) -> bool:
        return bool(self.homes)

    # The files written around every spawn, joined once.
    @functools.cached_property
    def _procs(self) -> tuple[str, ...]:
        return tuple(os.path.join(directory, "cgroup.procs") for directory in self.dirs)

    @functools.cached_property
    def _tasks(self) -> tuple[str, ...]:
        return tuple(os.path.join(directory, "tasks") for directory in self.dirs)

    @functools.cached_property
    def _home_tasks(self) -> tuple[str, ...]:
        return tuple(os.path.join(directory, "tasks") for directory in self.homes)

    def exists(self) -> bool:
        return all(map(os.path.isdir, self.dirs))

    def add(self, pid: int) -> None:
        """Move a process into the group; what it starts from then on is in it too."""
        _write_each(self._procs, str(pid).encode())

    @contextlib.contextmanager
    def joined_by_this_thread(self) -> Iterator[None]:
        """cgroup v1: the calling thread stays in the group while it starts a process, so the
        process is born inside it (what v2's CLONE_INTO_CGROUP does, which subprocess cannot ask for).

        Moving another process takes the kernel's global threadgroup lock and its RCU sync:
        0.2 ms at p50 but 8 ms at p90 and 17 ms at p99 here. A thread moving itself skips that
        lock (0.2 ms at p99). The thread goes home even if the spawn fails. While it is inside, the
        pool process's own page faults are charged to the group: one vfork and exec, next to nothing.
        """
        _write_each(self._tasks, b"0")  # "0" is the writing thread itself
        try:
            yield
        finally:
            _write_each(self._home_tasks, b"0")


def _write_each(paths: tuple[str, ...], value: bytes) -> None:
    for path in paths:
        write_bytes(path, value)


class Cgroups:
    def __init__(self, parents: dict[str, Path], memory_bytes: int, processes: int) -> None:
        self.parents = parents  # limit file prefix → parent directory ("" for v2)
        self.memory_bytes = memory_bytes
        self.processes = processes
        # Page cache a call may leave charged to its group for the next call: above this the group
        # is renewed (see renew_if_charged), so a call's limit and peak are its own within 1/16.
        self.leftover_bytes = max(memory_bytes // 16, 4 * 1024 * 1024)
        self._own: tuple[int, CallGroup] | None = None
        self._generation = 0  # groups this process has had: its group's name ends with it
        self._retired: list[CallGroup] = []  # renewed groups, removed once empty

    def for_this_process(self) -> CallGroup:
        """The group of this pool process, made once and used for each call it runs in turn.

        A pool process runs one call at a time and no process outlives a call, so the group
        bounds exactly one call's tree. Making a fresh memory cgroup per call cost ~20 ms of
        bwrap start-up (measured in bench/; measured again with a loop of `bwrap true`: +1 ms at
        p50, +10 ms at p90, the removal waiting for the sandbox's init), and leaves a dying memcg
        behind each call that wrote files; joining an existing one costs ~0.1 ms, and usage is
        read as deltas (workers/usage.py). A group removed meanwhile (by an operator, say) is made
        again rather than failing every later call.
        """
        pid = os.getpid()
        if self._own is None or self._own[0] != pid or not self._own[1].exists():
            self._own = (pid, self.create(group_name(pid, self._generation)))
        return self._own[1]

    def renew_if_charged(self) -> None:
        """After a call, off its path: a group still charged with more than `leftover_bytes` (page
        cache of files the call wrote or read) is retired and the next call gets a fresh one.

        Inherited, that cache counts against the next call's memory limit, and dirty pages cannot
        be reclaimed in time: a 64 MiB call after one that wrote 50 MB was OOM-killed holding 14 MB
        of its own. The retired group keeps its cache (charged on to the parent, still cached) and
        is removed once empty. Making the new group costs 0.3-1 ms here, after the answer."""
        if self._own is None or self._own[0] != os.getpid():
            return
        self._retired = [group for group in self._retired if not remove_now(group)]
        held = charged_bytes(self._own[1])
        if held is not None and held > self.leftover_bytes:
            self._retired.append(self._own[1])
            self._generation += 1
            self._own = None
            with contextlib.suppress(OSError):  # else made at the next call, as after a removal
                self.for_this_process()

    def release_own(self) -> None:
        """Remove this process's groups, when it will run no more calls. Best effort: what is left
        is swept at the next worker start."""
        if self._own is None or self._own[0] != os.getpid():
            return
        for group in (self._own[1], *self._retired):
            for directory in group.dirs:
                _remove_when_empty(directory)
        self._own, self._retired = None, []

    @classmethod
    def detect(cls, memory_bytes: int, processes: int) -> "Cgroups | None":
        """Cgroup v2 or v1 with pids and memory controllers we may write to, else None."""
        try:
            parents = _v2_parent() if (CGROUP_ROOT / "cgroup.controllers").exists() else _v1_parents()
        except OSError as exc:
            log.warning("no per-call cgroups (%s); sandboxes are limited by rlimits only", exc.strerror or exc)
            return None
        if parents is None:
            log.warning("no writable pids/memory cgroups; sandboxes are limited by rlimits only")
            return None
        found = cls(parents, memory_bytes, processes)
        found.sweep()
        return found

    def sweep(self) -> None:
        """Remove the groups of pool processes that are gone (see remove_stale)."""
        for parent in set(self.parents.values()):
            remove_stale(parent)

    def create(self, name: str) -> CallGroup:
        made = []
        for parent in dict.fromkeys(self.parents.values()):
            directory = parent / name
            directory.mkdir(exist_ok=True)
            made.append(directory)
        homes = _v1_homes(self.parents) if "v2" not in self.parents else ()
        for kind, parent in self.parents.items():
            directory = parent / name
            if kind == "v2":
                (directory / "pids.max").write_text(str(self.processes))
                (directory / "memory.max").write_text(str(self.memory_bytes))
                if (directory / "memory.swap.max").exists():
                    (directory / "memory.swap.max").write_text("0")
            elif kind == "pids":
                (directory / "pids.max").write_text(str(self.processes))
            elif kind == "memory":
                (directory / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
                if (directory / "memory.memsw.limit_in_bytes").exists():  # swap accounting: no swap either
                    (directory / "memory.memsw.limit_in_bytes").write_text(str(self.memory_bytes))
        kinds = tuple((kind, parent / name) for kind, parent in self.parents.items())
        return CallGroup(tuple(made), homes, kinds)


def _v1_homes(parents: dict[str, Path]) -> tuple[Path, ...]:
    """This process's own v1 groups, in the order of `parents`, or () where one is not writable
    from here (then sandboxes are moved in after they start, as on v2)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    homes = []
    for controller in parents:
        if controller not in own:
            return ()
        home = CGROUP_ROOT / controller / own[controller].lstrip("/")
        if not os.access(home / "tasks", os.W_OK):
            return ()
        homes.append(home)
    return tuple(homes)


def _v1_parents() -> dict[str, Path] | None:
    """pids and memory, which bound the tree, and cpuacct where it can be had (only measured)."""
    parents = {}
    for controller in ("pids", "memory", "cpuacct"):
        hierarchy = CGROUP_ROOT / controller
        if not hierarchy.is_dir() or not os.access(hierarchy, os.W_OK):
            if controller == "cpuacct":
                continue  # cpu_time_ms is null then; the limits still hold
            return None
        parent = hierarchy / GROUP
        parent.mkdir(exist_ok=True)
        parents[controller] = parent
    limits_only = {kind: parent for kind, parent in parents.items() if kind != "cpuacct"}
    if "cpuacct" in parents and not _v1_homes(parents) and _v1_homes(limits_only):
        return limits_only  # a cpuacct home not writable from here would cost every spawn the slower move-in
    return parents


def _v2_parent() -> dict[str, Path] | None:
    if not os.access(CGROUP_ROOT, os.W_OK):
        return None
    parent = CGROUP_ROOT / GROUP
    parent.mkdir(exist_ok=True)
    for directory in (CGROUP_ROOT, parent):
        controllers = (directory / "cgroup.controllers").read_text().split()
        if not {"pids", "memory"} <= set(controllers):
            return None
        (directory / "cgroup.subtree_control").write_text("+pids +memory")
    return {"v2": parent}


def remove_stale(parent: Path) -> None:
    """Remove the groups of pool processes that are gone (killed, or ended before they could
    remove theirs), whatever their age: a group is named by its process's pid and start time, so
    a live process's group, this worker's or another's, is kept. Busy groups cannot be removed
    anyway. (Groups named `pool-<pid>`, by workers before start times were in the name, count as
    gone.) A process in another PID namespace sharing this cgroup tree looks gone from here: its
    idle group is removed and made again at its next call (Cgroups.for_this_process).

    Before, only groups older than ten minutes went, and nothing removed a group when its
    process ended: every worker stopped within ten minutes of the last start left its groups."""
    for child in parent.iterdir():
        if child.is_dir() and not _owner_alive(child.name):
            with contextlib.suppress(OSError):
                child.rmdir()


def _remove_when_empty(directory: Path, bound_s: float = 2.0) -> None:
    """rmdir a group, waiting (a little) for the last call's sandbox init to be gone: bwrap exits
    as soon as it has the command's status, while its init may still be exiting (busy, EBUSY)."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            directory.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return
        time.sleep(0.01)


def group_name(pid: int, generation: int = 0) -> str:
    """`pool-<pid>-<start time>`: pids come round again (pid_max is 32768 here, and every shell call
    starts several processes), and a new process must never inherit a dead one's group with
    whatever it left charged or running there. A renewed group adds `.<generation>`."""
    return f"pool-{pid}-{_start_time(pid)}" + (f".{generation}" if generation else "")


def charged_bytes(group: CallGroup) -> int | None:
    """What the group's memory holds now (its processes are gone: page cache), None if unreadable."""
    for kind, name in (("v2", "memory.current"), ("memory", "memory.usage_in_bytes")):
        if (directory := group.directory(kind)) is not None:
            try:
                return int(read_bytes(os.path.join(directory, name)))
            except (OSError, ValueError):
                return None
    return None


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """A small cgroup file at once (no buffered file object: these are read around every call)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike[str], value: bytes) -> None:
    """One write to a cgroup file (each write is one command to the kernel: a pid, a limit, a reset)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def remove_now(group: CallGroup) -> bool:
    """rmdir the group's directories if they are empty; False while one is still busy."""
    gone = True
    for directory in group.dirs:
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            gone = False
    return gone


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (proc(5), field 22), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields from the 3rd on follow the command's ")"


def _owner_alive(name: str) -> bool:
    """Whether `name` is the group of a process that still exists (in this PID namespace)."""
    _, _, owner = name.partition("pool-")
    pid, _, started = owner.partition("-")
    return pid.isdigit() and _start_time(int(pid)) == started.partition(".")[0]
