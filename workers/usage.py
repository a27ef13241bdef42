"""What one call's process tree used, read from its cgroup: peak memory, cpu time, OOM kills.

A pool process's group is reused call after call (workers/cgroups.py: a fresh memory group per call
cost ~20 ms of bwrap start-up), so every figure is a delta over the call, taken by a Meter started
just before the spawn and stopped once the sandbox is gone:

- cpu time: cpuacct.usage (v1, ns) or cpu.stat usage_usec (v2), after minus before;
- OOM kills: memory.oom_control's oom_kill (v1) or memory.events' oom_kill (v2), after minus before;
- peak memory: the group's high-water mark is reset at the start (v1: a write to
  memory.max_usage_in_bytes; v2: a write to memory.peak, which Linux 6.12 and later keep per open
  file), and what it held then is subtracted: that is page cache left charged to the group by the
  pool process's earlier calls (it is reclaimed first when a call needs the room), not this call's.

Starting and stopping cost 0.1 ms together (a write and six small reads), against 6-8 ms for the
spawn. A figure that cannot be read is None, never guessed: no cgroup, no cpuacct hierarchy, or a
v2 kernel whose memory.peak cannot be reset (before 6.12).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from shared.endings import UNMEASURED, Usage
from workers.cgroups import CallGroup, Cgroups, read_bytes, write_bytes

log = logging.getLogger("runwarden.usage")


class Meter(Protocol):
    def stop(self) -> Usage: ...

    def handover(self) -> tuple[dict[str, Any], list[int]]:
        """What another process needs to stop this meter (`resume`): its figures at the start,
        and the fds it holds, which it then owns (sent with SCM_RIGHTS). This one is spent."""


class _Unmeasured:
    """A host that gives runwarden no cgroup: nothing is known."""

    def stop(self) -> Usage:
        return UNMEASURED

    def handover(self) -> tuple[dict[str, Any], list[int]]:
        return {"kind": "none"}, []


NO_METER = _Unmeasured()


def start(group: CallGroup) -> Meter:
    """A meter of the group's next call, started now; a group that cannot be read gives nulls."""
    try:
        if (directory := group.directory("v2")) is not None:
            return _V2Meter(directory)
        memory = group.directory("memory")
        return _V1Meter(memory, group.directory("cpuacct")) if memory is not None else NO_METER
    except (OSError, ValueError, KeyError) as exc:
        log.warning("cannot read the call's cgroup (%s): its usage is null", exc)
        return NO_METER


def _keyed(path: Path | str, key: bytes) -> int:
    """A value of a flat-keyed file (`name value` lines: memory.oom_control, memory.events, cpu.stat)."""
    for line in read_bytes(path).splitlines():
        name, _, value = line.partition(b" ")
        if name == key:
            return int(value)
    raise KeyError(f"{os.path.basename(path)} has no {key.decode()}")


class _V1Meter:
    def __init__(self, memory: Path, cpuacct: Path | None, started: dict[str, Any] | None = None) -> None:
        self.memory, self.cpuacct = memory, cpuacct
        # Read at the start and the stop of every call: joined once, as strings.
        self._peak = os.path.join(memory, "memory.max_usage_in_bytes")
        self._oom = os.path.join(memory, "memory.oom_control")
        self._cpu = os.path.join(cpuacct, "cpuacct.usage") if cpuacct is not None else None
        if started is not None:  # resumed: started by another process (see handover)
            self.held, self.oom_kills, self.cpu_ns = started["held"], started["oom_kills"], started["cpu_ns"]
            return
        write_bytes(self._peak, b"0")  # the mark restarts at what the group holds now
        self.held = int(read_bytes(self._peak))
        self.oom_kills = _keyed(self._oom, b"oom_kill")
        self.cpu_ns = int(read_bytes(self._cpu)) if self._cpu is not None else None

    def handover(self) -> tuple[dict[str, Any], list[int]]:
        return {"kind": "v1", "memory": str(self.memory), "cpuacct": str(self.cpuacct) if self.cpuacct else None,
                "held": self.held, "oom_kills": self.oom_kills, "cpu_ns": self.cpu_ns}, []

    def stop(self) -> Usage:
        try:
            peak = int(read_bytes(self._peak)) - self.held
            oom_kills = _keyed(self._oom, b"oom_kill") - self.oom_kills
            cpu_ms = None
            if self._cpu is not None and self.cpu_ns is not None:
                cpu_ms = (int(read_bytes(self._cpu)) - self.cpu_ns) // 1_000_000
        except (OSError, ValueError, KeyError) as exc:
            log.warning("cannot read the call's cgroup (%s): its usage is null", exc)
            return UNMEASURED
        return Usage(peak_memory_bytes=max(peak, 0), cpu_time_ms=cpu_ms, oom_kills=max(oom_kills, 0))


class _V2Meter:
    def __init__(self, directory: Path, started: dict[str, Any] | None = None, peak_fd: int | None = None) -> None:
        self.directory = directory
        if started is not None:  # resumed: the reset memory.peak fd came with it
            self.oom_kills, self.cpu_us, self.held, self.peak_fd = (started["oom_kills"], started["cpu_us"],
                                                                    started["held"], peak_fd)
            return
        self.oom_kills = _keyed(directory / "memory.events", b"oom_kill")
        self.cpu_us = _keyed(directory / "cpu.stat", b"usage_usec")
        self.peak_fd, self.held = _reset_peak(directory / "memory.peak")  # last: nothing after it can fail

    def handover(self) -> tuple[dict[str, Any], list[int]]:
        """memory.peak's reset is per open file (Linux 6.12): the fd itself travels."""
        fds, self.peak_fd = ([self.peak_fd] if self.peak_fd is not None else []), None
        return {"kind": "v2", "directory": str(self.directory), "oom_kills": self.oom_kills, "cpu_us": self.cpu_us,
                "held": self.held, "peak": bool(fds)}, fds

    def stop(self) -> Usage:
        try:
            peak = None
            if self.peak_fd is not None:
                os.lseek(self.peak_fd, 0, os.SEEK_SET)
                peak = max(int(os.read(self.peak_fd, 64)) - self.held, 0)
            oom_kills = _keyed(self.directory / "memory.events", b"oom_kill") - self.oom_kills
            cpu_ms = (_keyed(self.directory / "cpu.stat", b"usage_usec") - self.cpu_us) // 1000
        except (OSError, ValueError, KeyError) as exc:
            log.warning("cannot read the call's cgroup (%s): its usage is null", exc)
            return UNMEASURED
        finally:
            if self.peak_fd is not None:
                os.close(self.peak_fd)
        return Usage(peak_memory_bytes=peak, cpu_time_ms=cpu_ms, oom_kills=max(oom_kills, 0))


def resume(started: dict[str, Any], fds: list[int]) -> Meter:
    """A meter another process started (its `handover`), to stop here; `fds` are the ones it sent."""
    try:
        if started["kind"] == "v1":
            return _V1Meter(Path(started["memory"]), Path(started["cpuacct"]) if started["cpuacct"] else None, started)
        if started["kind"] == "v2":
            return _V2Meter(Path(started["directory"]), started, fds[0] if started["peak"] and fds else None)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("cannot resume a call's meter (%s): its usage is null", exc)
    for fd in fds:
        os.close(fd)
    return NO_METER


def _reset_peak(path: Path) -> tuple[int | None, int]:
    """An fd of memory.peak reset to the group's current charge, and that charge; (None, 0) where
    the kernel cannot reset it (before 6.12, or no memory.peak before 5.19): the peak is null."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None, 0
    try:
        os.write(fd, b"reset\n")
        os.lseek(fd, 0, os.SEEK_SET)
        return fd, int(os.read(fd, 64))
    except (OSError, ValueError):
        os.close(fd)
        return None, 0


def measured_by(cgroups: Cgroups | None) -> frozenset[str]:
    """Which usage figures calls get on this host (the worker's cgroups, as detected): what the
    README's table says, and what a test may expect to be non-null."""
    if cgroups is None:
        return frozenset()
    if "v2" in cgroups.parents:
        fd, _ = _reset_peak(cgroups.parents["v2"] / "memory.peak")  # a reset is per open file: harmless
        if fd is not None:
            os.close(fd)
        return frozenset({"cpu_time_ms", "oom_kills"} | ({"peak_memory_bytes"} if fd is not None else set()))
    return frozenset({"peak_memory_bytes", "oom_kills"} | ({"cpu_time_ms"} if "cpuacct" in cgroups.parents else set()))
