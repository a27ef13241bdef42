"""The sandbox floor: the product's own BwrapRunner (same argv, same rlimits, same uid drop), spawning `true`.

The floor gets its own root (next to the product's workspaces, under the same 0711 directory) so
building its runner never rewrites files the product worker's sandboxes bind.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from shared.settings import Settings
from workers import sandbox


def floor_settings(settings: Settings, floor_root: Path) -> Settings:
    return dataclasses.replace(settings, workspaces=floor_root)


def build(settings: Settings, floor_root: Path) -> tuple[sandbox.BwrapRunner, Path]:
    """The runner `build_runner` would give the worker, and a workspace for it to bind."""
    runner = sandbox.build_runner(floor_settings(settings, floor_root))
    if not isinstance(runner, sandbox.BwrapRunner):
        raise SystemExit("the benchmark needs RUNWARDEN_SANDBOX=bwrap")
    workspace = floor_root / "ws"
    workspace.mkdir(parents=True, exist_ok=True)
    if runner.host_uid is not None:
        os.chown(workspace, runner.host_uid, runner.host_uid)
    return runner, workspace


def spawn_true(runner: sandbox.BwrapRunner, workspace: Path) -> int:
    """`bwrap … -- /bin/bash -c true` exactly as a shell call starts it, waited for."""
    process = runner.spawn("true", workspace, "", network=False)
    process.popen.communicate()
    return process.popen.returncode


def bare_true() -> int:
    return subprocess.run(["true"], check=False).returncode
