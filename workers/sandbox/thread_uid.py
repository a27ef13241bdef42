"""A root worker's uid drop for its sandboxes, made by the spawning thread alone, around the spawn.

bwrap must not run as host root, so a root worker starts it as the unprivileged sandbox uid. Linux
keeps credentials per thread; POSIX's set*id calls change every thread of a process, which glibc
does by signalling each one, and CPython's subprocess therefore forks the whole pool process
instead of vforking when given `user=` (~12 ms from a large one). The raw system calls change the
calling thread only. So, for the few microseconds of a spawn, the spawning thread becomes the uid
while keeping root as its saved uid; subprocess's vfork child is born with the thread's
credentials, and its exec of bwrap makes all three ids the uid's (the saved id follows the
effective one) with no capabilities left (neither the real nor the effective id is 0); then the
thread takes root back. The pool process's other threads stay root throughout. This replaces
`setpriv`'s exec, which cost ~1.3 ms and ~1.4 ms of CPU of every spawn (measured on a 2-core VM).

What the kernel does to a thread whose credentials change is undone with them: it clears the
thread's parent-death signal (billiard's pool processes set one) and marks the whole process
undumpable. Garbage collection is held off meanwhile, so no finalizer runs as the uid.
"""
from __future__ import annotations

import _signal
import contextlib
import ctypes
import gc
import os
import platform
import sys
import threading
from collections.abc import Iterator

# (setgroups, setresgid, setresuid) by machine: the raw calls, not glibc's process-wide wrappers.
_SYSCALLS = {"x86_64": (116, 119, 117), "aarch64": (159, 149, 147)}
_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG, _PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 1, 2, 3, 4
_UNCHANGED = -1
# `_signal`: the C functions under `signal`'s wrappers, which turn each of 64 signal numbers into an
# enum (~0.17 ms a spawn on a 2-core VM), for sets that only go back to the kernel.
_ALL_SIGNALS = _signal.valid_signals()


class ThreadUid:
    """Makes the calling thread, and only it, `uid` (and its gid, no supplementary groups) within
    `become()`; subprocess can then vfork and exec as that uid."""

    def __init__(self, uid: int, numbers: tuple[int, int, int]) -> None:
        self.uid = uid
        self._setgroups, self._setresgid, self._setresuid = numbers
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._lock = threading.Lock()  # one spawn at a time in a process: the GC hold is process-wide
        self._root = os.getresuid(), os.getresgid(), os.getgroups()  # what each thread is taken back to
        self._flags = 0, 1  # the parent-death signal and dumpable flag seen by the last spawn

    @classmethod
    def for_this_machine(cls, uid: int) -> ThreadUid | None:
        """None where the raw calls' numbers are not known (then setpriv does the drop)."""
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or not sys.platform.startswith("linux") or os.geteuid() != 0:
            return None
        return cls(uid, numbers)

    @contextlib.contextmanager
    def become(self) -> Iterator[None]:
        with self._lock:
            if os.getresuid() != self._root[0]:
                # Only a signal's exception, raised between the spawn and the take-back, leaves a
                # thread dropped: it then fails what needs root (closed), and is whole again here.
                self._take_back(*self._flags)
            death_signal, dumpable = self._prctl_get(_PR_GET_PDEATHSIG), self._prctl(_PR_GET_DUMPABLE)
            self._flags = death_signal, dumpable
            collecting = gc.isenabled()
            gc.disable()
            try:
                self._set_groups([])
                self._call(self._setresgid, self.uid, self.uid, _UNCHANGED)  # the saved ids stay root's
                self._call(self._setresuid, self.uid, self.uid, _UNCHANGED)
                yield
            finally:
                self._take_back(death_signal, dumpable)
                if collecting:
                    gc.enable()

    def _take_back(self, death_signal: int, dumpable: int) -> None:
        uids, gids, groups = self._root
        # Signals wait meanwhile: a Python handler raising here (Celery's, on the main thread)
        # would leave the thread half taken back.
        blocked = _signal.pthread_sigmask(_signal.SIG_BLOCK, _ALL_SIGNALS)
        try:
            self._call(self._setresuid, *uids)  # first: root's capabilities are needed for the rest
            self._call(self._setresgid, *gids)
            self._set_groups(groups)
            self._prctl(_PR_SET_PDEATHSIG, death_signal)
            self._prctl(_PR_SET_DUMPABLE, dumpable)
        except OSError as exc:  # cannot happen with a saved uid of 0; never go on half dropped
            os.write(2, f"runwarden: the spawning thread could not take its ids back: {exc}\n".encode())
            os._exit(70)
        finally:
            _signal.pthread_sigmask(_signal.SIG_SETMASK, blocked)

    def _set_groups(self, groups: list[int]) -> None:
        array = (ctypes.c_uint * len(groups))(*groups)
        self._call(self._setgroups, len(groups), array)

    def _call(self, number: int, *args: object) -> None:
        _checked(self._libc.syscall(number, *args))

    def _prctl(self, option: int, value: int = 0) -> int:
        return _checked(self._libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0))

    def _prctl_get(self, option: int) -> int:
        value = ctypes.c_int()
        _checked(self._libc.prctl(option, ctypes.byref(value), 0, 0, 0))
        return value.value


def _checked(result: int) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return int(result)
