"""CPU per call under load, by process, from /proc: what explains a throughput gap on a machine
whose cores are the limit.

Each stack process counts with everything it has reaped (utime + stime + cutime + cstime), and
each process under it (a pool child, a gunicorn worker, the keeper) counts for the stack process it
descends from. A bare sandbox's own processes are not all there: bwrap exits as soon as its command
has, so the sandbox's PID 1 (with the shell it reaped) is reaped by the host's init, and its exit
(the namespaces and mounts torn down) is counted there. runwarden's pool processes and keeper reap
their sandboxes' inits themselves (workers/sandbox/orphans.py), so theirs count for the worker.
Hence the last row: the machine's busy time (/proc/stat) less the rows above, which is mostly the
bare sandboxes' insides and the kernel's threads.
"""
from __future__ import annotations

import os
from typing import Any

from bench.stack import proc_stats

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
# The roles a report compares, by the names it prints.
API, BARE_API = "runwarden API (gunicorn)", "bare Flask app (gunicorn)"
WORKER = "runwarden worker (main + pool + keeper + their bwrap)"
BARE_WORKER = "bare Celery worker (main + pool + its bwrap)"
REDIS, BENCH, MACHINE = "redis-server", "bench client", "machine"
REST = "rest of the machine: kernel threads; the bare sandboxes' insides (reaped by the host's init)"


def _processes() -> dict[int, tuple[int, int]]:
    """pid → (parent pid, CPU ticks including reaped children) for every process now."""
    return {pid: (int(fields[1]), sum(int(value) for value in fields[11:15])) for pid, fields in proc_stats()}


def _busy_ticks() -> int:
    with open("/proc/stat") as stat:
        values = [int(value) for value in stat.readline().split()[1:]]
    # user, nice, system, irq, softirq: not idle, iowait, the hypervisor's steal, nor guest (in user already)
    return sum(values[0:3]) + values[5] + values[6]


class Snapshot:
    """Ticks by role at one moment; `roots` names the processes whose trees are attributed."""

    def __init__(self, roots: dict[int, str]) -> None:
        self.busy = _busy_ticks()
        self.by_pid = _processes()
        self.roles: dict[int, str] = {}
        for pid in self.by_pid:
            role = self._role(pid, roots)
            if role is not None:
                self.roles[pid] = role

    def _role(self, pid: int, roots: dict[int, str]) -> str | None:
        seen = 0
        while pid in self.by_pid and seen < 64:
            if pid in roots:
                return roots[pid]
            pid, seen = self.by_pid[pid][0], seen + 1
        return None


def roots(stack_children: list[tuple[str, Any]]) -> dict[int, str]:
    """The bench process and each process the bench stack started, by a name a reader knows."""
    names = {"redis": REDIS, "api": API, "bare-api": BARE_API, "bare-worker": BARE_WORKER, "floor-api": "floor app",
             "floor-worker": "floor worker", "bench-keeper": "bench's own keeper"}
    found = {os.getpid(): BENCH}
    for name, process in stack_children:
        found[process.pid] = names.get(name, WORKER if name.startswith("bench-") else name)
    return found


def per_call(before: Snapshot, after: Snapshot, calls: int) -> dict[str, float]:
    """Milliseconds of CPU per call by role, for processes alive at both moments, and the rest."""
    ms: dict[str, float] = {}
    for pid, role in after.roles.items():
        if pid in before.by_pid:
            ticks = after.by_pid[pid][1] - before.by_pid[pid][1]
            ms[role] = ms.get(role, 0.0) + ticks * TICK_S * 1000 / max(1, calls)
    total = (after.busy - before.busy) * TICK_S * 1000 / max(1, calls)
    ms[REST] = max(0.0, total - sum(ms.values()))
    ms[MACHINE] = total
    return {role: round(value, 3) for role, value in ms.items() if value >= 0.005 or role == MACHINE}
