"""What workers leave on the host: the per-call cgroups of their pool processes (issue 18 item 9),
and the sandboxes' inits (workers/sandbox/orphans.py).

A stack of its own, so its workers can be killed and stopped: a pool process killed outright
leaves its group to the next worker start's sweep, which must spare the groups of live pool
processes of other workers; a pool process that ends, or a worker that stops, takes its groups
with it. bwrap exits before the sandbox's init has: the process that spawned it reaps that init,
so no zombie is left to the host's init, holding its pid and one of the next call's pids.
"""
from __future__ import annotations

import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from runwarden import devstack
from shared.settings import Settings
from tests.conftest import ALL_SCOPES, Agent, reachable_workspaces, start_stack
from tests.test_faults import (
    pool_children,  # a worker's keeper is its child too, not a pool process
)
from tests.sandboxes import parent_of
from tests.waiting import wait_until
from workers import cgroups, sandbox
from workers.sandbox import orphans


def group_parents() -> list[Path]:
    """Where runwarden's groups are: one directory on cgroup v2, one per controller on v1."""
    if (cgroups.CGROUP_ROOT / "cgroup.controllers").exists():
        return [cgroups.CGROUP_ROOT / cgroups.GROUP]
    return [cgroups.CGROUP_ROOT / controller / cgroups.GROUP for controller in ("pids", "memory")]


def groups_of(pid: int) -> list[Path]:
    """The group directories of a live process (its name holds the process's start time)."""
    name = cgroups.group_name(pid)
    assert name.endswith(tuple("0123456789")), f"{pid} is gone"
    return [parent / name for parent in group_parents()]


def wait(check, what: str, timeout_s: float = 60) -> None:  # type: ignore[no-untyped-def]
    devstack.wait_for(check, timeout_s, what)


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    if os.geteuid() != 0 or not all(parent.parent.is_dir() for parent in group_parents()):
        pytest.skip("per-call cgroups need a root worker and a writable cgroup hierarchy")
    workspaces = reachable_workspaces()
    # Every sandbox cold: a prepared one lives in its keeper's group, and these are the pool processes'.
    info = start_stack(tmp_path_factory.mktemp("leftovers"), concurrency=1, RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_PREPARED_SANDBOXES="0")
    if not all(parent.is_dir() for parent in group_parents()):
        info.stack.stop()
        pytest.skip("the worker found no cgroups it may write (see its log)")
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


def shell_ok(agent: Agent) -> None:
    response = agent.shell("true", wait=30)
    assert response.status_code == 200 and response.json()["result"]["exit_code"] == 0, response.text


def test_dead_pool_processes_leave_no_cgroups(own_stack) -> None:
    agent = Agent(own_stack, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])
    first = next(process for name, process in own_stack.stack.children if name.startswith("w0-"))
    assert not any(group.exists() for group in groups_of(first.pid))  # the self-test's group went with it
    wait(lambda: len(pool_children(first.pid)) == 1, "worker A's pool process")
    [killed] = pool_children(first.pid)
    shell_ok(agent)  # concurrency 1, one worker: this call ran in `killed`, which made its group
    dead_groups = groups_of(killed)
    assert all(group.is_dir() for group in dead_groups)

    os.kill(killed, signal.SIGKILL)
    wait(lambda: pool_children(first.pid) not in ([], [killed]), "the replacement pool process")
    [live] = pool_children(first.pid)
    shell_ok(agent)
    live_groups = groups_of(live)
    assert all(group.is_dir() for group in live_groups)
    assert all(group.is_dir() for group in dead_groups)  # nothing removed the killed one's

    log = own_stack.logs / "worker-b.log"
    second = devstack.start_worker(own_stack.stack, own_stack.env, concurrency=1, name=f"wb-{uuid.uuid4().hex[:6]}",
                                   log=log)
    wait(lambda: log.exists() and " ready." in log.read_text(errors="replace"), "worker B")
    assert not any(group.exists() for group in dead_groups)  # swept at B's start
    assert all(group.is_dir() for group in live_groups)  # A's live pool process keeps its own

    # A stops as an orchestrator stops it (SIGTERM to its main process): its pool process ends and
    # removes its group. B stops as `runwarden dev` does (SIGTERM to its whole process group, which
    # kills its pool process at once): B sweeps once its pool has stopped.
    os.kill(first.pid, signal.SIGTERM)
    first.wait(60)
    assert not any(group.exists() for group in live_groups)
    [second_child] = pool_children(second.pid)
    shell_ok(agent)  # B's now
    second_groups = groups_of(second_child)
    assert all(group.is_dir() for group in second_groups)
    os.killpg(second.pid, signal.SIGTERM)
    second.wait(60)
    assert not any(group.exists() for group in second_groups)


def test_the_spawner_reaps_each_sandbox_init_itself() -> None:
    workspaces = reachable_workspaces()
    runner = sandbox.build_runner(Settings.from_env({"RUNWARDEN_REDIS_URL": "redis://unused",
                                                    "RUNWARDEN_WORKSPACES": str(workspaces)}, require_jwt=False))
    if not isinstance(runner, sandbox.BwrapRunner):
        pytest.skip("needs bwrap")
    workspace = workspaces / "ws"
    workspace.mkdir()
    if runner.host_uid is not None:
        os.chown(workspace, runner.host_uid, runner.host_uid)
    assert orphans.become_subreaper()  # as each pool process and the keeper do
    try:
        inits = []
        for _ in range(100):  # back to back, as a busy pool process runs them
            process = runner.spawn("exit 0", workspace, "", network=False)
            inits.append(process.group_leader)
            assert sandbox.communicate(process, timeout_s=30)[0] == 0
            # Reaped, or still ours until the next spawn reaps it: never the host init's zombie.
            assert parent_of(inits[-1]) in (None, os.getpid())
        wait_until(lambda: (orphans.reap_pending(), not orphans.pending())[1], 30, "the last inits reaped")
        assert [pid for pid in inits if parent_of(pid) == os.getpid()] == []
        if runner.cgroups is not None:  # nothing left charged to the group the next call gets
            group = runner.cgroups.for_this_process()
            counted = group.directory("pids") or group.directory("v2")
            assert counted is not None and (counted / "pids.current").read_text().strip() == "0"
    finally:
        orphans.become_subreaper(False)
        if runner.cgroups is not None:
            runner.cgroups.release_own()
        shutil.rmtree(workspaces, ignore_errors=True)
