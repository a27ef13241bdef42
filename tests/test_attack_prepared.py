"""Prepared sandboxes (workers/sandbox/keeper.py), attacked: a sandbox the keeper started ahead of a
run's next call serves that call alone, only a call of its own run, grant and network, with the
isolation, limits and usage of a cold one (the whole sandbox attack suite runs on both paths:
tests/test_attack_sandbox.py, tests/test_results.py), and no longer than it may: never past its
token's end or revocation, its workspace's replacement or deletion, its idle time or the keeper's
bound, and never when it died. Its keeper is reachable by no sandbox.

Through the API on the session stack where a test needs calls; against a keeper process of its own
(real bwrap, no Celery) where it needs the keeper's bounds set otherwise.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from runwarden import devstack
from shared import revocations
from shared.paths import WHOLE_WORKSPACE
from shared.settings import Settings
from tests.archives import Operator, file, tar
from tests.conftest import StackInfo, start_stack
from tests.sandboxes import (ask, counts, host_processes_with, keeper, key_of, parent_of, prepared_for,
                             ready_after_calls, wait_ready)
from tests.streams import collect, connect
from tests.waiting import run, wait_until
from workers.sandbox.base import Ahead, Key
from workers.sandbox.prepared import KeeperClient, offer_name


def prepared(agent) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The run's next sandbox, ready (calls made first, if the run has none prepared)."""
    return ready_after_calls(agent, lambda: run(agent, "true"))


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def watch_until_reaped(init: int) -> list[int | None]:
    """The parents `init` had until it was reaped (workers/sandbox/orphans.py): bwrap exits before
    its sandbox's init, which then goes to the process that spawned bwrap, never the host's init."""
    parents: list[int | None] = []
    wait_until(lambda: (parents.append(parent_of(init)), parents[-1] is None)[1], 30, f"init {init} reaped")
    return parents


# --- single use --------------------------------------------------------------------------------------

def test_a_prepared_sandbox_serves_one_call_and_leaves_nothing_to_the_next(make_agent) -> None:
    """A call leaves a process (setsid, nohup), a /tmp file, an exported variable and an open fd;
    the run's next call, in the next prepared sandbox, sees none of them, in a fresh PID namespace,
    and the first's process is gone from the host."""
    agent = make_agent()
    marker = f"300.{secrets.randbelow(10**6):06d}"
    first_child = prepared(agent)["child"]
    hits, misses = counts(agent.stack, str(agent.workspace))
    left = run(agent, f"export LEAK=1; echo x > /tmp/left; exec 7>/tmp/fd7; (setsid nohup sleep {marker} >/dev/null 2>&1 &); "
                      "sleep 0.1; ps -eo args | grep -c '^sleep'; cut -d' ' -f22 /proc/1/stat")
    assert left["stdout"].split()[0] == "1", left  # its leftover ran, inside its own sandbox
    next_child = wait_ready(agent.stack, key_of(agent))["child"]
    assert next_child != first_child  # the one handed over is not handed again
    wait_until(lambda: not host_processes_with(marker), 30, "the first call's leftover process to end")
    probe = run(agent, "ls -A /tmp; echo ---; env | grep -c LEAK; ps -eo args | grep -c '^sleep'; "
                       "ls /proc/self/fd | tr '\\n' ' '; echo; cut -d' ' -f22 /proc/1/stat")
    tmp, rest = probe["stdout"].split("---\n")
    leak, sleepers, fds, started = rest.splitlines()
    assert (tmp, leak, sleepers, fds) == ("", "0", "0", "0 1 2 3 "), probe
    assert started != left["stdout"].split()[1]  # another init, another PID namespace
    assert counts(agent.stack, str(agent.workspace)) == (hits + 2, misses)  # both were prepared ones


def test_each_sandbox_init_is_reaped_by_its_spawner_cold_and_prepared(make_agent, stack) -> None:
    """A prepared sandbox's init is reaped by the keeper, a cold one's by its pool process: no
    zombie is left to the host's init (whose pid, and one of the next call's pids, it would hold)."""
    agent = make_agent()
    child = prepared(agent)["child"]
    run(agent, "true")  # takes it
    assert 1 not in watch_until_reaped(child)

    marker = f"1.{secrets.randbelow(10**6):06d}"
    ask(stack, {"op": "pause", "on": True})  # every call cold
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(run, agent, f"sleep {marker}")
            [sleeper] = wait_until(lambda: host_processes_with(marker), 30, "the cold call's command")
            init = sleeper  # the first bwrap above the command is the sandbox's init
            while Path(f"/proc/{init}/comm").read_text().strip() != "bwrap":
                init = parent_of(init) or 1
                assert init != 1, "no bwrap above the command"
            bwrap = parent_of(init)
            pool_process = parent_of(bwrap or 1)
            assert call.result(timeout=60)["exit_code"] == 0
        parents = watch_until_reaped(init)
        assert set(parents) - {None} <= {bwrap, pool_process}, parents
    finally:
        ask(stack, {"op": "pause", "on": False})


def test_a_prepared_call_sees_what_a_cold_one_sees(make_agent, stack) -> None:
    """Environment, identity, capabilities, limits, cwd, $0 and open fds: the same on both paths."""
    probe = ("env | sort; id; grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; ulimit -a; pwd; echo $0; "
             "ls /proc/self/fd; ls -A /; hostname; cat /proc/self/cgroup | wc -l")
    agent = make_agent()
    ask(stack, {"op": "pause", "on": True})
    try:
        cold = run(agent, probe)
    finally:
        ask(stack, {"op": "pause", "on": False})
    prepared(agent)
    hits = counts(stack, str(agent.workspace))[0]
    warm = run(agent, probe)
    assert counts(stack, str(agent.workspace))[0] == hits + 1
    assert warm["stdout"] == cold["stdout"] and warm["stderr"] == cold["stderr"], (cold, warm)


# --- only its own run, grant and network ---------------------------------------------------------------

def test_a_sandbox_prepared_for_one_grant_never_serves_another(make_agent, stack) -> None:
    """The run's `**` token with the network has a sandbox prepared; a `docs/**` token of the same
    run without it, and another tenant's run of the same name, get none of it: their calls see
    only what their own grants show, and the prepared sandbox stays unclaimed."""
    full = make_agent(scopes=["files:write", "shell:exec", "shell:network"])
    full.write("secret.txt", b"the run's secret\n")
    full.write("docs/readme.md", b"the docs\n")
    waiting = prepared(full)
    port = stack.base_url.rsplit(":", 1)[1]
    probe = f"cat /workspace/secret.txt 2>&1; ls -A /workspace; (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo OPEN || echo closed"
    docs = make_agent(scopes=["shell:exec"], paths=["docs/**"], tenant=full.tenant, run_id=full.run_id)
    seen = run(docs, probe)
    assert "the run's secret" not in seen["stdout"] and seen["stdout"].endswith("docs\nclosed\n"), seen
    nonet = make_agent(scopes=["shell:exec"], tenant=full.tenant, run_id=full.run_id)
    seen = run(nonet, probe)
    assert seen["stdout"].startswith("the run's secret\n") and seen["stdout"].endswith("closed\n"), seen
    other = make_agent(tenant=f"t{uuid.uuid4().hex[:10]}", run_id=full.run_id)
    seen = run(other, probe)
    assert "the run's secret" not in seen["stdout"] and "docs" not in seen["stdout"], seen
    still = prepared_for(stack, key_of(full))
    assert still is not None and still["child"] == waiting["child"], still  # nobody else took it
    after = run(full, probe)  # its own next call does
    assert after["stdout"].startswith("the run's secret\n") and after["stdout"].endswith("OPEN\n"), after


def test_the_keeper_is_asked_only_for_a_workspace_it_marks(make_agent, stack) -> None:
    """While a sandbox waits for a run's next call, its workspace is marked beside the keeper's
    socket; a call whose workspace is not marked starts cold without asking (no claim, no miss)."""
    agent = make_agent()
    mark = keeper(stack).offers / offer_name(str(agent.workspace))
    prepared(agent)
    assert mark.exists() and stat.S_IMODE(mark.parent.stat().st_mode) == 0o700
    ask(stack, {"op": "pause", "on": True})  # kills what is prepared, and prepares nothing
    try:
        assert not mark.exists()
        hits, misses = counts(stack, str(agent.workspace))
        assert run(agent, "echo cold")["stdout"] == "cold\n"
        assert counts(stack, str(agent.workspace)) == (hits, misses)  # the keeper was not asked
    finally:
        ask(stack, {"op": "pause", "on": False})
    prepared(agent)
    hits = counts(stack, str(agent.workspace))[0]
    assert run(agent, "echo warm")["stdout"] == "warm\n"
    assert counts(stack, str(agent.workspace))[0] == hits + 1


# --- no longer than it may ----------------------------------------------------------------------------

def test_a_prepared_sandbox_that_died_is_not_used(make_agent, stack) -> None:
    agent = make_agent()
    child = prepared(agent)["child"]
    os.kill(child, signal.SIGKILL)
    wait_until(lambda: gone(child), 30, "the prepared sandbox's init to die")
    hits = counts(stack, str(agent.workspace))[0]
    result = run(agent, "echo fine")
    assert result["stdout"] == "fine\n" and result["exit_code"] == 0, result
    assert counts(stack, str(agent.workspace))[0] == hits  # it started cold


def test_a_replaced_or_deleted_workspace_is_never_served_by_a_sandbox_prepared_before(make_agent, stack) -> None:
    operator = Operator(stack, f"t{uuid.uuid4().hex[:10]}")
    assert operator.put("r1", tar(file("old.txt", b"old\n"))).status_code == 201
    agent = make_agent(tenant=operator.tenant, run_id="r1")
    assert run(agent, "ls")["stdout"] == "old.txt\n"
    child = wait_ready(stack, key_of(agent))["child"]
    hits = counts(stack, str(agent.workspace))[0]
    assert operator.put("r1", tar(file("new.txt", b"new\n")), replace=True).status_code == 201
    assert run(agent, "ls; cat *")["stdout"] == "new.txt\nnew\n"  # at once: never the old tree
    assert counts(stack, str(agent.workspace))[0] == hits  # it started cold
    wait_until(lambda: gone(child), 30, "the replaced workspace's prepared sandbox to be killed")
    child = wait_ready(stack, key_of(agent))["child"]
    assert operator.delete("r1").status_code == 204
    wait_until(lambda: prepared_for(stack, key_of(agent)) is None and gone(child), 30,
               "the deleted workspace's prepared sandbox to be killed")


def test_a_workspace_moved_behind_a_prepared_sandbox_is_not_served_by_it(make_agent, stack) -> None:
    """The run's `docs` is renamed and made again (by a call of the run) after its next sandbox
    was prepared with the old one bound: the next call must see the new docs, never the old."""
    full = make_agent()
    full.write("docs/a.md", b"old docs\n")
    docs = make_agent(scopes=["shell:exec"], paths=["docs/**"], tenant=full.tenant, run_id=full.run_id)
    assert run(docs, "ls docs")["stdout"] == "a.md\n"
    wait_ready(stack, key_of(docs))
    os.rename(full.workspace / "docs", full.workspace / "archived")  # as `mv docs archived; mkdir docs` would
    (full.workspace / "docs").mkdir()
    os.chown(full.workspace / "docs", *(lambda st: (st.st_uid, st.st_gid))(os.stat(full.workspace)))
    assert run(docs, "ls -A docs; echo end")["stdout"] == "end\n"


# --- no process outlives its call: the pool process that held it dies ---------------------------------

@pytest.fixture(scope="module")
def lone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """A worker with one pool process, so the test knows which one holds the sandbox."""
    workspaces = devstack.reachable_dir("runwarden-ws-")
    info = start_stack(tmp_path_factory.mktemp("lone"), concurrency=1, RUNWARDEN_WORKSPACES=str(workspaces))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


def test_a_pool_process_killed_mid_call_takes_its_prepared_sandbox_with_it(lone: StackInfo) -> None:
    """The keeper is the sandbox's parent, not the pool process: the pool process's connection to
    the keeper is the sandbox's lease, and its end kills the sandbox (as --die-with-parent does
    for a cold one)."""
    from tests.conftest import Agent, ALL_SCOPES
    agent = Agent(lone, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])
    prepared(agent)
    hits = counts(lone, str(agent.workspace))[0]
    marker = f"300.{secrets.randbelow(10**6):06d}"
    accepted = agent.shell(f"echo started; sleep {marker}", wait=None)
    assert accepted.status_code == 202, accepted.text
    ws = connect(agent, accepted.json()["task_id"])
    try:
        assert collect(ws, limit=1).events[0]["data"] == "started\n"
        sleepers = wait_until(lambda: host_processes_with(marker), 30, "the sandboxed sleep")
        assert counts(lone, str(agent.workspace))[0] == hits + 1  # it runs in the prepared sandbox
        worker = next(popen for name, popen in lone.stack.children if name.startswith("w"))
        children = [int(p) for p in Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()]
        pool = [pid for pid in children if "celery" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
        assert len(pool) == 1, pool
        os.kill(pool[0], signal.SIGKILL)
        wait_until(lambda: not host_processes_with(marker), 30, "the sandboxed sleep to end with its pool process")
        assert all(gone(pid) for pid in sleepers)
    finally:
        ws.close()


def test_nothing_is_prepared_after_a_runs_first_call_nor_while_another_of_its_calls_waits(lone: StackInfo) -> None:
    """Preparing costs a sandbox's start on the worker's CPU: it is asked for only when a call ends
    on a run that was there before it (many runs make one call) and has no other call queued or
    running (that one would start before a sandbox is ready). A run's first call does not even ask
    for one to take. One pool process runs the calls in
    turn, and its requests reach the keeper in order, so what a call asked is known by the next."""
    from tests.conftest import Agent, ALL_SCOPES
    tenant = f"t{uuid.uuid4().hex[:10]}"
    new, seen = (Agent(lone, tenant, f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"]) for _ in range(2))
    run(seen, "true")  # makes its workspace
    run(new, "true")  # the first call of a run: its workspace is made by it
    run(seen, "true")  # a run seen before: its next sandbox is asked for after this call
    wait_ready(lone, key_of(seen))
    assert prepared_for(lone, key_of(new)) is None
    assert counts(lone, str(new.workspace)) == (0, 0)  # nor was the keeper asked for one to take: none could be
    assert ready_after_calls(new, lambda: run(new, "true"))["ready"]  # its second call prepares

    busy = seen
    run(busy, "true")  # takes what was prepared; asks for the next
    wait_ready(lone, key_of(busy))
    go = busy.workspace / "go"
    hits, misses = counts(lone, str(busy.workspace))
    first = busy.shell("while [ ! -e go ]; do sleep 0.01; done; echo first", wait=None)
    assert first.status_code == 202, first.text
    first_id = first.json()["task_id"]
    wait_until(lambda: busy.get(first_id).json()["status"] == "running", 30, "the first call to run")
    second = busy.shell("echo second", wait=None)  # queued behind it: one pool process
    assert second.status_code == 202, second.text
    go.write_text("")
    for task_id in (first_id, second.json()["task_id"]):
        wait_until(lambda: busy.get(task_id).json()["status"] == "completed", 60, "the calls to end")
    # The first took the prepared sandbox; when it ended the second was queued, so nothing was
    # prepared for it, and it started cold, without asking the keeper (nothing was marked).
    assert counts(lone, str(busy.workspace)) == (hits + 1, misses)


# --- the keeper: reachable by no sandbox, and only by its worker -----------------------------------------

def test_no_sandbox_reaches_the_keeper(make_agent, stack) -> None:
    """A `shell:network` sandbox shares the host's network namespace, so it can list the host's
    Unix sockets (/proc/net/unix) and would reach an abstract one: the keeper's is a path, which
    no sandbox's mount namespace has."""
    agent = make_agent(scopes=["shell:exec", "shell:network"])
    script = ("import socket, sys\n"
              "paths = [l.split()[-1] for l in open('/proc/net/unix') if 'keeper' in l and l.split()[-1][:1] in '/@']\n"
              "for p in paths:\n"
              "    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
              "    try:\n"
              "        s.connect('\\0' + p[1:] if p.startswith('@') else p); print('CONNECTED', p)\n"
              "    except OSError as e:\n"
              "        print('refused', e.errno)\n"
              "print('listed', len(paths))\n")
    encoded = __import__("base64").b64encode(script.encode()).decode()
    result = run(agent, f"echo {encoded} | base64 -d | python3")
    assert "CONNECTED" not in result["stdout"], result
    assert re.search(r"listed \d+", result["stdout"]), result
    assert "@" not in "".join(line for line in Path("/proc/net/unix").read_text().splitlines() if "keeper" in line)


def test_only_root_and_the_workers_uid_may_talk_to_the_keeper(stack) -> None:
    from tests.sandboxes import keeper
    path = keeper(stack).path
    probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
             "try:\n    s.connect(sys.argv[1]); print('CONNECTED')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    other = subprocess.run(["/usr/bin/python3", "-c", probe, str(path)], capture_output=True, text=True, timeout=30,
                           user=65534, group=65534, extra_groups=[])
    assert other.stdout.startswith("refused"), other
    assert ask(stack, {"op": "status"})["ok"] is True  # root may: the positive control


# --- the keeper's bounds, against a keeper of its own ------------------------------------------------------

@pytest.fixture
def own_keeper(request: pytest.FixtureRequest, stack: StackInfo) -> Iterator[tuple[KeeperClient, Path, subprocess.Popen[bytes]]]:
    """A keeper of 2 sandboxes, idle 2 s at most (or as the test's `idle` mark says), on the
    session stack's Redis."""
    root = devstack.reachable_dir("rw-keeper-")
    idle = request.node.get_closest_marker("idle")
    env = {**stack.env, "RUNWARDEN_WORKSPACES": str(root / "ws"), "RUNWARDEN_PREPARED_SANDBOXES": "2",
           "RUNWARDEN_PREPARED_IDLE": str(idle.args[0] if idle else 2)}
    settings = Settings.from_env(env, require_jwt=False)
    settings.workspaces.mkdir(parents=True)
    path = root / "keeper" / "k.sock"
    process = subprocess.Popen([sys.executable, "-m", "workers.sandbox.keeper", "--socket", str(path)], env=env)
    try:
        wait_until(lambda: path.exists() or process.poll() is not None, 60, "the keeper to listen")
        assert process.poll() is None, "the keeper did not start"
        yield KeeperClient(path), settings.workspaces, process
    finally:
        process.terminate()
        process.wait(30)
        shutil.rmtree(root, ignore_errors=True)


def _workspace(root: Path, name: str) -> Key:
    path = root / "t" / name
    path.mkdir(parents=True)
    os.chown(path, 65534, 65534) if os.geteuid() == 0 else None
    return Key(str(path), False, WHOLE_WORKSPACE)


def _status(client: KeeperClient) -> dict[str, Any]:
    answer = client.request({"op": "status"})
    assert answer is not None
    return answer[0]


def _ready(client: KeeperClient) -> list[str]:
    return [entry["workspace"] for entry in _status(client)["prepared"] if entry["ready"]]


def test_the_keeper_keeps_no_more_than_its_bound_and_drops_the_oldest(own_keeper) -> None:  # type: ignore[no-untyped-def]
    client, root, _ = own_keeper
    keys = [_workspace(root, f"r{i}") for i in range(3)]
    for key in keys:
        client.prepare(Ahead(key, "t", None, time.time() + 600))
        wait_until(lambda: key.workspace in _ready(client), 60, "the sandbox to be ready")
        assert len(_status(client)["prepared"]) <= 2
    assert _ready(client) == [keys[1].workspace, keys[2].workspace]


def test_an_unclaimed_sandbox_is_killed_after_its_idle_time(own_keeper) -> None:  # type: ignore[no-untyped-def]
    client, root, _ = own_keeper
    key = _workspace(root, "idle")
    client.prepare(Ahead(key, "t", None, time.time() + 600))
    child = wait_until(lambda: next((e["child"] for e in _status(client)["prepared"] if e["ready"]), None), 60,
                       "the sandbox to be ready")
    wait_until(lambda: not _status(client)["prepared"] and gone(child), 30, "it to expire (2 s idle)")


def test_no_sandbox_for_a_token_that_has_ended_and_none_past_its_end(own_keeper) -> None:  # type: ignore[no-untyped-def]
    client, root, _ = own_keeper
    ended, ending = _workspace(root, "ended"), _workspace(root, "ending")
    client.prepare(Ahead(ended, "t", None, time.time() - 1))
    client.prepare(Ahead(ending, "t", None, time.time() + 600))
    wait_until(lambda: ending.workspace in _ready(client), 60, "the good token's sandbox to be ready")
    assert ended.workspace not in [entry["workspace"] for entry in _status(client)["prepared"]]
    # The idle time (2 s) would end it too; this token ends sooner and keeps being refreshed.
    soon = _workspace(root, "soon")
    client.prepare(Ahead(soon, "t", None, time.time() + 3))
    wait_until(lambda: soon.workspace in _ready(client), 60, "the short token's sandbox to be ready")
    wait_until(lambda: soon.workspace not in [e["workspace"] for e in _status(client)["prepared"]], 30,
               "the sandbox to end with its token")


@pytest.mark.idle(600)  # so only the revocation can end it within the wait
def test_revoking_its_token_kills_a_prepared_sandbox(own_keeper, stack) -> None:  # type: ignore[no-untyped-def]
    client, root, _ = own_keeper
    key, jti = _workspace(root, "revoked"), uuid.uuid4().hex
    client.prepare(Ahead(key, "t", jti, time.time() + 600))
    child = wait_until(lambda: next((e["child"] for e in _status(client)["prepared"] if e["ready"]), None), 60,
                       "the sandbox to be ready")
    revocations.revoke(stack.redis, jti, 3600, "t")
    wait_until(lambda: not _status(client)["prepared"] and gone(child), 30, "the revoked token's sandbox to be killed")
    client.prepare(Ahead(_workspace(root, "again"), "t", jti, time.time() + 600))  # nor started again for it
    assert _status(client)["prepared"] == []


def test_a_claim_for_another_key_gets_nothing(own_keeper) -> None:  # type: ignore[no-untyped-def]
    client, root, _ = own_keeper
    key = _workspace(root, "mine")
    client.prepare(Ahead(key, "t", None, time.time() + 600))
    wait_until(lambda: key.workspace in _ready(client), 60, "the sandbox to be ready")
    for other in (Key(key.workspace, True, WHOLE_WORKSPACE), Key(key.workspace + "x", False, WHOLE_WORKSPACE),
                  Key(key.workspace, False, __import__("shared.paths", fromlist=["shell_view"]).shell_view(("docs/**",)))):
        assert client.claim(other) is None
    handed = client.claim(key)
    assert handed is not None
    assert client.claim(key) is None  # single use
    handed.kill()
    handed.wait(30)
    handed.close()
