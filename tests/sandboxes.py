"""Run a test's shell calls on one sandbox path, and know that they did: `cold` (the worker's
keeper paused, so every sandbox is spawned by the pool process for its call) or `prepared` (each
call takes the sandbox the keeper started for its run while nothing ran: calls are made first if
the run has none, and the test waits until the keeper reports it ready, a state, not a time).

The keeper is asked through its own socket (root may), as an operator would: `status` tells what
is prepared and, per workspace, how many claims it served (hits) and how many found nothing
(misses); `pause` stops it preparing and handing over.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import requests

from shared.paths import shell_view
from shared.settings import Settings
from workers.sandbox.base import Key
from workers.sandbox.prepared import KeeperClient, keeper_socket
from tests.waiting import wait_until

READY_TIMEOUT_S = 60


def keeper(stack: Any) -> KeeperClient:
    """The keeper of the stack's first worker."""
    worker = next(popen for name, popen in stack.stack.children if name.startswith(("w", "node")))
    return KeeperClient(keeper_socket(Settings.from_env(stack.env, require_jwt=False), worker.pid))


def ask(stack: Any, message: dict[str, Any]) -> dict[str, Any]:
    client = keeper(stack)
    answer = client.request(message)
    assert answer is not None, "the keeper did not answer"
    return answer[0]


def key_of(agent: Any, paths: tuple[str, ...] | None = None) -> Key:
    token_paths = paths if paths is not None else agent.paths
    return Key(str(agent.workspace), "shell:network" in agent.scopes, shell_view(tuple(token_paths)))


def prepared_for(stack: Any, key: Key) -> dict[str, Any] | None:
    wire = key.wire()
    for entry in ask(stack, {"op": "status"})["prepared"]:
        if {k: entry[k] for k in wire} == wire:
            return entry
    return None


def counts(stack: Any, workspace: str) -> tuple[int, int]:
    found = ask(stack, {"op": "status"})["stats"].get(workspace, {"hits": 0, "misses": 0})
    return found["hits"], found["misses"]


def wait_ready(stack: Any, key: Key) -> dict[str, Any]:
    return wait_until(lambda: (entry := prepared_for(stack, key)) and entry["ready"] and entry,
                      READY_TIMEOUT_S, "the keeper to have the run's next sandbox ready")


def ready_after_calls(agent: Any, call_true: Callable[[], object]) -> dict[str, Any]:
    """The run's next sandbox, ready. The keeper is asked for one when a call ends on a run whose
    workspace was there before it (and no other of its calls is queued or running): a run without
    a workspace makes a first call, which makes it, then the one after which it is prepared."""
    key = key_of(agent)
    if prepared_for(agent.stack, key) is None:
        if not agent.workspace.is_dir():
            call_true()
        call_true()
    return wait_ready(agent.stack, key)


class SandboxPath:
    """One path for the shell calls of the agents it wraps; `finish` checks they took it."""

    def __init__(self, stack: Any, mode: str) -> None:
        self.stack, self.mode = stack, mode
        self.probes: dict[str, int] = {}  # workspace → calls made on the path
        self.before: dict[str, tuple[int, int]] = {}  # workspace → (hits, misses) before its first

    def start(self) -> None:
        ask(self.stack, {"op": "pause", "on": self.mode == "cold"})

    def finish(self) -> None:
        try:
            for workspace, probes in self.probes.items():
                hits, misses = counts(self.stack, workspace)
                hits_before, misses_before = self.before[workspace]
                if self.mode == "prepared":
                    assert misses == misses_before and hits - hits_before >= probes, \
                        f"{probes} call(s) were to take a prepared sandbox: {hits - hits_before} did, " \
                        f"{misses - misses_before} started cold"
                else:
                    assert hits == hits_before, "a call took a prepared sandbox while the keeper was paused"
        finally:
            ask(self.stack, {"op": "pause", "on": False})

    def wrap(self, agent: Any) -> Any:
        agent.shell = functools.partial(self._shell, agent, agent.shell)
        return agent

    def _shell(self, agent: Any, shell: Any, command: str, **kwargs: Any) -> requests.Response:
        workspace = str(agent.workspace)
        if self.mode == "prepared":
            def call_true() -> None:
                response = shell("true", wait=60)
                assert response.status_code == 200, response.text
            ready_after_calls(agent, call_true)
        if workspace not in self.probes:
            self.before[workspace] = counts(self.stack, workspace)
        self.probes[workspace] = self.probes.get(workspace, 0) + 1
        return shell(command, **kwargs)


def host_processes_with(text: str) -> list[int]:
    """Host pids whose command line contains `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found

def workspace_path(stack: Any, tenant: str, run_id: str) -> Path:
    return stack.workspaces / tenant / run_id


def parent_of(pid: int) -> int | None:
    """Its parent's pid, None once it is reaped."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None
