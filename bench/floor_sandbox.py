"""The sandbox floor and runwarden's spawn as parts.

- The floor (`bare_bwrap_true`): bwrap with every namespace unshared, the system's /usr read-only, a
  /proc, a /dev and a /tmp, running /usr/bin/true, spawned with `subprocess.run` (the same bwrap
  binary the product runs): what a sandbox costs with nothing of runwarden in it.
- Parts, runwarden's cost: the product's own BwrapRunner (its argv, uid drop, limits, view) spawning
  `true`, without its per-call cgroup (`spawn_true`) and with it (`spawn_true(..., cgroup=True)`).

The floor gets its own root (next to the product's workspaces, under the same 0711 directory) so
building its runner never rewrites files the product worker's sandboxes bind.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from shared.paths import WHOLE_WORKSPACE
from shared.settings import Settings
from workers import sandbox
from workers.sandbox.prepared import KeeperClient


@dataclasses.dataclass
class FloorSandbox:
    bare: sandbox.BwrapRunner      # per-call cgroups off: the floor
    product: sandbox.BwrapRunner   # exactly as built for the worker (per-call cgroups where the host allows)
    workspace: Path
    keeper: KeeperClient | None = None  # a keeper of the bench's own, for the hand-over part


def start_keeper(floor: FloorSandbox, env: dict[str, str], root: Path) -> subprocess.Popen[bytes]:
    """The product's keeper for the floor's workspace (as a worker starts it), for `handover_true`."""
    path = root / "keeper" / "bench.sock"
    process = subprocess.Popen([sys.executable, "-m", "workers.sandbox.keeper", "--socket", str(path)],
                               env={**env, "RUNWARDEN_WORKSPACES": str(root)}, start_new_session=True)
    deadline = time.monotonic() + 60
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    floor.keeper = KeeperClient(path)
    return process


def handover_true(floor: FloorSandbox) -> float:
    """Seconds from claiming a prepared sandbox to `true`'s exit, read to its end and let go, as a
    shell call does with it; the preparation (asked for, then waited for until ready) is untimed."""
    assert floor.keeper is not None
    key = sandbox.Key(str(floor.workspace), False, WHOLE_WORKSPACE)
    floor.keeper.prepare(sandbox.Ahead(key, "bench", None, time.time() + 600))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = floor.keeper.request({"op": "status"})
        if answer and any(entry["ready"] for entry in answer[0]["prepared"]):
            break
        time.sleep(0.005)
    t0 = time.perf_counter()
    handed = floor.keeper.claim(key)
    if handed is None:
        raise RuntimeError("the bench's keeper handed nothing over")
    stdin, handed.stdin = handed.stdin, -1
    sandbox.write_frame(stdin, "", "true")
    code = sandbox.communicate(handed, timeout_s=30)[0]
    elapsed = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"a prepared sandbox's true exited {code}")
    return elapsed


def build(settings: Settings, floor_root: Path) -> FloorSandbox:
    """The runner `build_runner` gives the worker, and a workspace for it to bind."""
    runner = sandbox.build_runner(dataclasses.replace(settings, workspaces=floor_root))
    if not isinstance(runner, sandbox.BwrapRunner):
        raise SystemExit("the benchmark needs RUNWARDEN_SANDBOX=bwrap")
    workspace = floor_root / "ws"
    workspace.mkdir(parents=True, exist_ok=True)
    if runner.host_uid is not None:
        os.chown(workspace, runner.host_uid, runner.host_uid)
    bare = copy.copy(runner)
    bare.cgroups = None
    return FloorSandbox(bare, runner, workspace)


def spawn_true(floor: FloorSandbox, *, cgroup: bool = False) -> int:
    """`bwrap … -- /bin/bash -c true` as a shell call starts it, waited for and cleaned up."""
    runner = floor.product if cgroup else floor.bare
    process = runner.spawn("true", floor.workspace, "", False)
    return sandbox.communicate(process, timeout_s=30)[0]


BARE_BWRAP_ENV = "BENCH_BARE_BWRAP"  # the bwrap the bare floor worker runs: the product's


def bare_argv(bwrap: str) -> list[str]:
    return [bwrap, "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--", "/usr/bin/true"]


def bare_bwrap_true(bwrap: str) -> int:
    return subprocess.run(bare_argv(bwrap), check=False).returncode


def bare_true() -> int:
    return subprocess.run(["true"], check=False).returncode
