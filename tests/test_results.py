"""Shell results that explain themselves (contract section 13): `termination`, and the usage of the
call's whole process tree read from its cgroup, on real sandboxes and real cgroups.

Usage figures are asserted where the worker measures them and asserted null where it cannot: the
test detects cgroups the way the worker does (`Cgroups.detect`, `usage.measured_by`), so on a host
without them these tests check that nothing is made up rather than skip.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

import pytest

from shared.endings import Termination, decide
from shared.settings import Settings
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack
from tests.sandboxes import SandboxPath
from tests.streams import collect, connect, watch
from tests.waiting import cancel, ended, wait_until
from workers import usage
from workers.cgroups import Cgroups

SMALL_MEMORY = 64 * 1024 * 1024
SMALL_CAP = 256 * 1024
SUMMARY = ("exit_code", "signal", "timed_out", "duration_ms", "stdout_bytes", "stderr_bytes", "stdout_sha256",
           "stderr_sha256", "truncated", "termination", "peak_memory_bytes", "cpu_time_ms")


def measured(stack: StackInfo) -> frozenset[str]:
    """The usage figures this host's workers give (as the worker detects its cgroups)."""
    settings = Settings.from_env(stack.env, require_jwt=False)
    return usage.measured_by(Cgroups.detect(settings.sandbox_memory_bytes, settings.sandbox_max_processes))


def start(agent: Agent, command: str, **parameters: Any) -> str:
    response = agent.shell(command, wait=None, **parameters)
    assert response.status_code == 202, response.text
    return response.json()["task_id"]


def run_to_end(agent: Agent, command: str, **parameters: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the exit event, the GET result) of a call run to its end."""
    task_id = start(agent, command, **parameters)
    exit_event = watch(agent, task_id).exit
    return exit_event, ended(agent, task_id)["result"]


def assert_one_type(exit_event: dict[str, Any], result: dict[str, Any]) -> None:
    """The exit event and the result say the same of how the call ended, field for field."""
    assert {name: exit_event[name] for name in SUMMARY} == {name: result[name] for name in SUMMARY}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A stack whose sandboxes get 64 MiB of memory and whose output cap is 256 KiB."""
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("small"), concurrency=1, RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_SANDBOX_MEMORY=str(SMALL_MEMORY), RUNWARDEN_OUTPUT_CAP=str(SMALL_CAP))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


@pytest.fixture(params=["cold", "prepared"])
def small_path(request: pytest.FixtureRequest, small: StackInfo):  # type: ignore[no-untyped-def]
    path = SandboxPath(small, request.param)
    path.start()
    yield path
    path.finish()


# Usage and termination are the same on both paths (contract section 13): each test that runs its
# calls one after another runs twice, in sandboxes spawned for the call and in prepared ones.
@pytest.fixture
def small_agent(small: StackInfo, small_path: SandboxPath) -> Agent:
    return small_path.wrap(Agent(small, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"]))


@pytest.fixture
def agent(make_agent: Any, sandbox_path: SandboxPath) -> Agent:
    return sandbox_path.wrap(make_agent())


def test_precedence_of_what_runwarden_knows() -> None:
    """runwarden's own acts come first (cancel, timer, cap), then the kernel's OOM kills, and only
    then whether the command died of a signal."""
    base = dict(cancelled=False, timed_out=False, capped=False, oom_kills=0, died_of_signal=False)
    assert decide(**base) is Termination.EXITED
    assert decide(**{**base, "died_of_signal": True}) is Termination.SIGNALED
    assert decide(**{**base, "died_of_signal": True, "oom_kills": 1}) is Termination.OOM_KILLED
    assert decide(**{**base, "oom_kills": 1, "capped": True}) is Termination.OUTPUT_CAPPED
    assert decide(**{**base, "capped": True, "timed_out": True}) is Termination.TIMED_OUT
    assert decide(**{**base, "timed_out": True, "cancelled": True, "died_of_signal": True}) is Termination.CANCELLED


def test_a_command_that_exits_reports_its_usage(agent: Agent) -> None:
    exit_event, result = run_to_end(agent, "echo hi; exit 3")
    assert_one_type(exit_event, result)
    assert result["termination"] == "exited" and result["exit_code"] == 3 and result["signal"] is None
    figures = measured(agent.stack)
    for name in ("peak_memory_bytes", "cpu_time_ms"):
        if name in figures:
            assert isinstance(result[name], int) and result[name] >= 0, result
        else:
            assert result[name] is None, result  # never made up
    if "peak_memory_bytes" in figures:
        assert result["peak_memory_bytes"] > 0  # bash ran: it held some memory


def test_cpu_time_grows_with_the_work_done(agent: Agent) -> None:
    """Busy loops bounded by a count, not a time: eight times the iterations, more cpu time (cpu
    time is what the tree computed, so a loaded machine changes wall time, not this)."""
    loop = "i=0; while [ $i -lt {n} ]; do i=$((i+1)); done"
    _, light = run_to_end(agent, loop.format(n=25_000))
    _, heavy = run_to_end(agent, loop.format(n=200_000))
    assert light["termination"] == heavy["termination"] == "exited"
    if "cpu_time_ms" not in measured(agent.stack):
        assert light["cpu_time_ms"] is None and heavy["cpu_time_ms"] is None
        return
    assert heavy["cpu_time_ms"] > light["cpu_time_ms"], (light["cpu_time_ms"], heavy["cpu_time_ms"])
    assert heavy["cpu_time_ms"] >= 50, heavy  # 175,000 more bash iterations are no free lunch


def test_peak_memory_follows_what_the_tree_holds(agent: Agent) -> None:
    """A child process holding 160 MiB (below the 1 GiB limit) shows in the call's peak."""
    hold = "python3 -c 'import sys; a = bytearray(160 << 20); sys.stdout.write(str(len(a)))'"
    _, small = run_to_end(agent, "true")
    _, large = run_to_end(agent, f"{hold}; echo")
    assert large["stdout"] == f"{160 << 20}\n" and large["termination"] == "exited"
    if "peak_memory_bytes" not in measured(agent.stack):
        assert small["peak_memory_bytes"] is None and large["peak_memory_bytes"] is None
        return
    assert large["peak_memory_bytes"] >= 160 << 20, large
    assert small["peak_memory_bytes"] < 32 << 20, small


def test_page_cache_an_earlier_call_left_is_not_the_next_calls(small_agent: Agent) -> None:
    """A call that writes 40 MB leaves its page cache (dirty for a while) charged to its pool
    process's group; the group is renewed after it, so the next call's 64 MiB and its peak are its
    own (inherited, the cache got a 40 MiB allocation OOM-killed). One pool process runs both."""
    _, writer = run_to_end(small_agent, "head -c 40000000 /dev/zero > big.bin")
    assert writer["termination"] == "exited"
    if "peak_memory_bytes" not in measured(small_agent.stack):
        assert writer["peak_memory_bytes"] is None
        return
    assert writer["peak_memory_bytes"] >= 40_000_000  # its own page cache, charged to its group
    _, holder = run_to_end(small_agent, "python3 -c 'a = bytearray(40 << 20)'")
    assert holder["termination"] == "exited" and holder["exit_code"] == 0, holder
    assert 40 << 20 <= holder["peak_memory_bytes"] < SMALL_MEMORY, holder


@pytest.mark.parametrize("allocation", ["chunks", "one_block"])
def test_a_memory_hog_is_oom_killed_and_says_so(small_agent: Agent, allocation: str) -> None:
    """Past its 64 MiB, the hog is killed by the kernel (the cgroup's limit, not the rlimit, is
    the one it meets: even one 200 MiB block, which RLIMIT_AS alone refused as MemoryError), and
    the result names it with the peak near the limit. Without cgroups the rlimit refuses it."""
    hog = {"chunks": "a = [bytearray(1 << 20) for _ in range(256)]", "one_block": "a = bytearray(200 << 20)"}
    exit_event, result = run_to_end(small_agent, f"python3 -c '{hog[allocation]}'")
    assert_one_type(exit_event, result)
    if "oom_kills" not in measured(small_agent.stack):
        assert result["termination"] == "exited" and result["exit_code"] == 1, result  # MemoryError
        assert "MemoryError" in result["stderr"] and result["peak_memory_bytes"] is None
        return
    assert result["termination"] == "oom_killed", result
    assert result["exit_code"] == 137 and result["signal"] == "SIGKILL", result
    if "peak_memory_bytes" in measured(small_agent.stack):
        assert SMALL_MEMORY // 2 < result["peak_memory_bytes"] <= SMALL_MEMORY, result
    _, after = run_to_end(small_agent, "echo still-serving")
    assert after["stdout"] == "still-serving\n" and after["termination"] == "exited"
    assert small_agent.stack.stack.died() is None


def test_an_oom_kill_inside_a_script_is_named_even_when_the_script_goes_on(small_agent: Agent) -> None:
    """The kernel killed a process of the tree: that is the call's story, whatever the shell then
    did with the 137 (exit_code stays what the command chose)."""
    _, result = run_to_end(small_agent, "python3 -c 'a = [bytearray(1 << 20) for _ in range(256)]'; echo rc=$?")
    if "oom_kills" not in measured(small_agent.stack):
        assert result["termination"] == "exited" and result["stdout"] == "rc=1\n"
        return
    assert result["stdout"] == "rc=137\n" and result["exit_code"] == 0
    assert result["termination"] == "oom_killed"


def test_output_past_the_cap_is_output_capped(small_agent: Agent) -> None:
    exit_event, result = run_to_end(small_agent, "yes")
    assert_one_type(exit_event, result)
    assert result["termination"] == "output_capped" and result["truncated"] is True
    assert result["stdout_bytes"] == SMALL_CAP, result


def test_a_signal_from_inside_the_sandbox_is_signaled(agent: Agent) -> None:
    exit_event, result = run_to_end(agent, "echo go; kill -TERM $$")
    assert_one_type(exit_event, result)
    assert result["termination"] == "signaled" and result["signal"] == "SIGTERM" and result["exit_code"] == 143


@pytest.mark.parametrize("command, termination, exit_code",
                         [("echo ready; sleep 30", "signaled", 130),
                          ("trap 'exit 42' INT; echo ready; sleep 30 & wait", "exited", 42)],
                         ids=["dies_of_it", "handles_it"])
def test_a_signal_sent_on_the_stream(agent: Agent, command: str, termination: str, exit_code: int) -> None:
    """SIGINT from the client: a command that dies of it is `signaled`; one that handles it and
    exits ended by itself."""
    task_id = start(agent, command)
    ws = connect(agent, task_id)
    try:
        assert collect(ws, limit=1).events[0]["data"] == "ready\n"
        ws.send(json.dumps({"type": "signal", "signal": "SIGINT"}))
        exit_event = collect(ws).exit
    finally:
        ws.close()
    result = ended(agent, task_id)["result"]
    assert_one_type(exit_event, result)
    assert (result["termination"], result["exit_code"]) == (termination, exit_code), result


def test_a_timeout_is_timed_out(agent: Agent) -> None:
    exit_event, result = run_to_end(agent, "echo start; sleep 30", timeout_ms=500)
    assert_one_type(exit_event, result)
    assert result["termination"] == "timed_out" and result["timed_out"] is True


def test_a_cancel_is_cancelled_running_or_queued(make_agent: Any) -> None:
    """A running call's result and event say cancelled with its usage; a queued one's (it never ran)
    say cancelled with null usage. (Three calls of one run at once: whichever path each takes.)"""
    agent = make_agent()
    gate = f"go-{uuid.uuid4().hex[:8]}"
    blockers = [start(agent, f"echo ready; while [ ! -e {gate} ]; do sleep 0.05; done") for _ in range(2)]
    try:
        wait_until(lambda: all(agent.get(b).json()["status"] == "running" for b in blockers), 60,
                   "both pool processes to run a blocker")
        queued = start(agent, "echo never")
        assert agent.get(queued).json()["status"] == "queued"
        cancel(agent, queued)
        cancel(agent, blockers[0])
        running = ended(agent, blockers[0])
    finally:
        agent.workspace.mkdir(parents=True, exist_ok=True)
        (agent.workspace / gate).touch()
    assert running["status"] == "cancelled" and running["result"]["termination"] == "cancelled"
    assert_one_type(watch(agent, blockers[0]).exit, running["result"])
    never = ended(agent, queued)
    assert never["status"] == "cancelled" and never["result"]["termination"] == "cancelled"
    assert never["result"]["peak_memory_bytes"] is None and never["result"]["cpu_time_ms"] is None
    exit_event = watch(agent, queued).exit
    assert exit_event["termination"] == "cancelled" and exit_event["exit_code"] is None
    assert exit_event["peak_memory_bytes"] is None and exit_event["cpu_time_ms"] is None


def test_a_call_that_could_not_start_has_no_termination(make_agent: Any) -> None:
    """`failed`: the command never ran, so nothing ended it."""
    agent = make_agent()
    run_to_end(agent, "mkdir real && ln -s real link")
    task_id = start(agent, "true", cwd="link")
    exit_event = watch(agent, task_id).exit
    assert exit_event["status"] == "failed" and exit_event["error"] == "path_forbidden"
    assert exit_event["termination"] is None and exit_event["peak_memory_bytes"] is None


def test_a_renewed_pool_group_is_still_its_live_process_s() -> None:
    """Another worker's start sweeps the groups of dead pool processes: a group renewed after a call
    (named `pool-<pid>-<start>.<n>`) must still count as its live owner's."""
    from workers.cgroups import _owner_alive, group_name
    assert _owner_alive(group_name(os.getpid(), 3)) and group_name(os.getpid(), 3).endswith(".3")
    assert not _owner_alive(f"pool-{os.getpid()}-1.3")  # the same pid, started at another time


def test_the_model_reads_why_its_command_died(small_agent: Agent) -> None:
    """The model-native status line names the termination and the usage (section 8's status line)."""
    from tests.test_model_native import post, results, texts, tool_use
    hog = tool_use("execute_shell_command", {"command": "python3 -c 'a = bytearray(200 << 20)'"})
    quiet = tool_use("execute_shell_command", {"command": "echo fine"})
    killed, fine = results(post(small_agent, "/v1/tool-use", [hog, quiet]))
    status, quiet_status = texts(killed)[-1], texts(fine)[-1]
    assert fine["is_error"] is False and quiet_status.startswith("exit code 0")
    figures = measured(small_agent.stack)
    if "oom_kills" in figures:
        assert killed["is_error"] is True and "exit code 137; killed: out of memory" in status, status
        assert ("(peak " in status) == ("peak_memory_bytes" in figures)
    else:
        assert "exit code 1" in status and killed["is_error"] is True
    assert ("cpu time" in quiet_status) == ("cpu_time_ms" in figures), quiet_status
    assert ("peak memory" in quiet_status) == ("peak_memory_bytes" in figures), quiet_status
