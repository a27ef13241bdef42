"""Sandbox inits are reaped by the process that spawned their bwrap, not by the host's init.

bwrap exits as soon as it knows its command's exit status. Its child, the sandbox's PID 1, may still
be exiting then, so it is orphaned and goes to the nearest subreaper, or else to the host's init.
Some inits reap late: the VM's init here left 100+ zombies for a while. Until it is reaped, a
zombie still counts in the pids cgroup that a pool process's next calls get (workers/cgroups.py),
so a quick series of calls in one pool process ran out of pids (`Creating new namespace failed`)
after 300–500 calls. And once another process has reaped it, its pid may be reused while `kill`
and `init_has_forked` still name it.

A process that spawns sandboxes (each pool process, the keeper) therefore becomes a child
subreaper, and reaps each init by its pid once bwrap has been reaped, since that is when the init
becomes its child. An init that is still exiting then is reaped between calls (a pool process,
after the call's answer; the keeper, at its next tick). Only inits can come to it this way:
everything else in a sandbox is in the init's PID namespace and dies with it. One thread of a
process spawns (a pool process's task, the keeper's loop), so the pending inits are not locked.
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import time

log = logging.getLogger("runwarden.sandbox")

_PR_SET_CHILD_SUBREAPER = 36
_pending: dict[int, bool] = {}  # inits given to this process not reaped yet → waited for once already


def become_subreaper(on: bool = True) -> bool:
    """Make this process the subreaper of its descendants (a process attribute, not inherited
    across fork). False, with a warning, where the kernel refuses; the host's init reaps then."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(int(on)), 0, 0, 0) != 0:
        log.warning("cannot become a child subreaper (%s): the host's init reaps the sandboxes' inits",
                    os.strerror(ctypes.get_errno()))
        return False
    return True


def reap(init: int) -> None:
    """Reap `init` (its bwrap is reaped already) now if it has exited, else later (reap_pending)."""
    _pending.setdefault(init, False)
    reap_pending()


def reap_pending(wait_s: float = 0.0) -> None:
    """Reap the inits that have exited. Given `wait_s`, first wait up to that long in all for the
    others, each once (between calls: an init still exiting is done within milliseconds, but one
    held by a process the kernel cannot kill yet must not hold up every later call)."""
    deadline = time.monotonic() + wait_s
    for pid, waited in list(_pending.items()):
        if wait_s > 0 and not waited:
            _wait_for_exit(pid, deadline - time.monotonic())
            _pending[pid] = True
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours: this process is no subreaper, or bwrap reaped it
            done = pid
        if done:
            del _pending[pid]


def _wait_for_exit(pid: int, timeout_s: float) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone
        return
    try:
        select.select([pidfd], [], [], max(0.0, timeout_s))  # readable once it has exited
    finally:
        os.close(pidfd)


def pending() -> frozenset[int]:
    return frozenset(_pending)
