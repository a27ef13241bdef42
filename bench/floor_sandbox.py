"""The sandbox floor: the product's own BwrapRunner (same argv, rlimits, uid drop, info-fd handshake),
spawning `true` — with the product's per-call cgroup turned off, since that is runwarden's cost on top
of the bare spawn. `spawn_true(..., cgroup=True)` is the product's full spawn path, measured apart.

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


def bare_true() -> int:
    return subprocess.run(["true"], check=False).returncode
