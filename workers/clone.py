"""A git clone into a staging directory, by git in a sandbox with the network that sees only that
directory. What a repository holds is as untrusted as an archive, so the tree is checked the same
way afterwards (workers/archive.py `check_tree`); while git runs, the directory is measured every
few seconds and the clone stopped once it is over the quota, so a huge repository cannot fill the
disk first.
"""
from __future__ import annotations

import os
import selectors
import shlex
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from shared.errors import ArchiveRejected, CloneFailed
from shared.workspaces import GitSource
from workers.archive import Limits, measure
from workers.sandbox import Process, Runner

STDERR_TAIL_BYTES = 4096
POLL_S = 0.5
MEASURE_EVERY_S = 2.0


def command(source: GitSource) -> str:
    """git clone of the one commit asked for, over the URL's own protocol only (no redirect to
    file:// or ext::), never prompting for credentials."""
    protocols = ("http", "https") if source.scheme in ("http", "https") else ("git",)
    allowed = " ".join(f"-c protocol.{name}.allow=always" for name in protocols)
    branch = f" --branch {shlex.quote(source.ref)}" if source.ref else ""
    return (f"GIT_TERMINAL_PROMPT=0 exec git -c protocol.allow=never {allowed} -c credential.helper= "
            f"clone --quiet --depth 1 --no-tags{branch} -- {shlex.quote(source.url)} .")


def clone(runner: Runner, staging: Path, source: GitSource, deadline: float, limits: Limits,
          progress: Callable[[], None]) -> None:
    """Clone into the empty `staging` by `deadline` (monotonic); CloneFailed if git fails or is
    too slow, ArchiveRejected if the clone grows past `limits`. `progress` runs every poll."""
    process = runner.spawn(command(source), staging, "", network=True)
    try:
        tail = _wait(process, staging, deadline, limits, progress)
    finally:
        process.kill()  # the sandbox's init: whatever git left running ends with it
        code = process.wait()
        process.close()
    if code != 0:
        raise CloneFailed(f"git clone failed: {_last_line(tail)}")


def _wait(process: Process, staging: Path, deadline: float, limits: Limits, progress: Callable[[], None]) -> bytes:
    """Read git's output until it ends (keeping the end of stderr), measuring the clone meanwhile."""
    pipes = {process.stdout, process.stderr}
    stderr_fd = process.stderr
    selector = selectors.DefaultSelector()
    for fd in pipes:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    tail, next_measure = b"", time.monotonic() + MEASURE_EVERY_S
    try:
        while pipes or process.poll() is None:
            now = time.monotonic()
            if now >= deadline:
                raise CloneFailed("git clone did not finish in time.")
            if not pipes:  # git closed its output but has not exited yet
                with suppress(subprocess.TimeoutExpired):
                    process.wait(min(POLL_S, deadline - now))
            for key, _ in selector.select(min(POLL_S, deadline - now)) if pipes else ():
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fd)
                    pipes.discard(key.fd)
                elif key.fd == stderr_fd:
                    tail = (tail + data)[-STDERR_TAIL_BYTES:]
            if time.monotonic() >= next_measure:
                _refuse_if_over(staging, limits)
                progress()
                next_measure = time.monotonic() + MEASURE_EVERY_S
    finally:
        selector.close()
    return tail


def _refuse_if_over(staging: Path, limits: Limits) -> None:
    usage = measure(staging, limits.max_files + 1)
    if usage.files > limits.max_files or (limits.max_bytes and usage.total_bytes > limits.max_bytes):
        raise ArchiveRejected("The repository is larger than the workspace quota allows "
                              f"({limits.max_bytes or 'unlimited'} bytes, {limits.max_files} entries).", member=None)


def _last_line(tail: bytes) -> str:
    lines = [line.strip() for line in tail.decode("utf-8", "replace").splitlines() if line.strip()]
    text = lines[-1] if lines else "no message"
    return "".join(ch for ch in text if ch.isprintable())[:300]
