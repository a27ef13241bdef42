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
from pathlib import Path

from shared.settings import Settings
from workers import sandbox


@dataclasses.dataclass
class FloorSandbox:
    bare: sandbox.BwrapRunner      # per-call cgroups off: the floor
    product: sandbox.BwrapRunner   # exactly as built for the worker (per-call cgroups where the host allows)
    workspace: Path


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
