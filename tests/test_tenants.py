"""Tenant quotas (contract section 10) against the real stack: exact under concurrency, refusals that
consume nothing, and slots that come back however a call ends."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest
import requests

from shared import keys
from tests.conftest import Agent, StackInfo

BLOCKED = "until [ -e release ]; do sleep 0.02; done; echo released"


def tenant_cli(stack: StackInfo, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "runwarden.cli", "tenant", *args], env=stack.env,
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def active(stack: StackInfo, tenant: str) -> int:
    return int(stack.redis.scard(keys.tenant_active(tenant)))


def release(agent: Agent) -> None:
    """Let every blocked call of the agent's run end (they wait for this file). Written on the host:
    the pool's processes may all be held by those calls."""
    (agent.workspace / "release").write_bytes(b"go\n")


def test_tenant_set_and_show(stack: StackInfo, agent: Agent) -> None:
    shown = tenant_cli(stack, "set", agent.tenant, "--max-running", "7", "--calls-per-minute", "100")
    assert shown["quotas"]["max_running"] == 7 and shown["quotas"]["calls_per_minute"] == 100
    assert shown["overrides"] == ["calls_per_minute", "max_running"]
    again = tenant_cli(stack, "show", agent.tenant)
    assert again == shown and again["quotas"]["output_bytes_per_hour"] > 0


def test_max_running_is_exact_under_concurrency_and_slots_come_back(stack: StackInfo, agent: Agent) -> None:
    tenant_cli(stack, "set", agent.tenant, "--max-running", "3")
    keys_sent = [uuid.uuid4().hex for _ in range(24)]

    def submit(key: str) -> requests.Response:
        return agent.call("execute_shell_command", {"command": BLOCKED, "timeout_ms": 60000}, key=key)

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(submit, keys_sent))
    accepted = [a for a in answers if a.status_code == 202]
    refused = [a for a in answers if a.status_code == 429]
    assert len(accepted) == 3 and len(refused) == 21, [a.status_code for a in answers]
    problem = refused[0].json()
    assert problem["code"] == "quota_exceeded" and problem["quota"] == "max_running"
    assert refused[0].headers["Retry-After"] == "1"
    assert refused[0].headers["Content-Type"] == "application/problem+json"
    assert active(stack, agent.tenant) == 3
    # Another tenant is not refused for this one's quota.
    other = Agent(stack, f"t{uuid.uuid4().hex[:10]}", "r1", ["shell:exec"], ["**"])
    theirs = other.shell("echo mine", wait=None)
    assert theirs.status_code == 202, theirs.text

    release(agent)
    for response in accepted:
        task_id = response.json()["task_id"]
        wait_for(lambda: agent.get(task_id).json()["status"] == "completed", f"{task_id} to complete")
    wait_for(lambda: active(stack, agent.tenant) == 0, "the slots to come back")
    wait_for(lambda: other.get(theirs.json()["task_id"]).json()["status"] == "completed", "the other tenant's call")
    # A refused key was not consumed: the same key now runs.
    refused_key = keys_sent[answers.index(refused[0])]
    retried = agent.call("execute_shell_command", {"command": "echo later"}, key=refused_key)
    assert retried.status_code == 202, retried.text


def test_a_replay_is_answered_even_when_the_quota_is_spent(stack: StackInfo, agent: Agent) -> None:
    key = uuid.uuid4().hex
    first = agent.call("read_file", {"path": "nothing.txt"}, key=key)
    assert first.status_code == 404
    tenant_cli(stack, "set", agent.tenant, "--max-running", "1")
    blocked = agent.call("execute_shell_command", {"command": BLOCKED, "timeout_ms": 60000})
    assert blocked.status_code == 202
    assert agent.call("read_file", {"path": "other.txt"}).status_code == 429
    replay = agent.http.post(f"{stack.base_url}/v1/tool-calls", data=first.request.body,
                             headers=agent.headers(key), timeout=30)
    assert replay.status_code == 404 and replay.headers.get("Idempotent-Replayed") == "true"
    assert replay.content == first.content
    release(agent)
    wait_for(lambda: agent.get(blocked.json()["task_id"]).json()["status"] == "completed", "the blocked call")


def test_cancelled_calls_give_their_slot_back(stack: StackInfo, agent: Agent) -> None:
    tenant_cli(stack, "set", agent.tenant, "--max-running", "1")
    started = agent.call("execute_shell_command", {"command": BLOCKED, "timeout_ms": 60000})
    task_id = started.json()["task_id"]
    assert agent.call("read_file", {"path": "x"}).status_code == 429
    cancelled = agent.http.delete(f"{stack.base_url}/v1/tool-calls/{task_id}",
                                  headers={"Authorization": f"Bearer {agent.token}"}, timeout=30)
    assert cancelled.status_code in (200, 202)
    wait_for(lambda: agent.get(task_id).json()["status"] == "cancelled", "the cancel")
    wait_for(lambda: active(stack, agent.tenant) == 0, "the slot to come back")
    assert agent.call("read_file", {"path": "x"}).status_code == 404


def test_calls_per_minute(stack: StackInfo, agent: Agent) -> None:
    tenant_cli(stack, "set", agent.tenant, "--calls-per-minute", "3")
    codes = []
    # A minute may turn between two calls (the counter starts again): then the refusal comes at
    # most three calls later. It must come, and never before three calls were admitted.
    for _ in range(7):
        response = agent.call("read_file", {"path": "none"})
        codes.append(response.status_code)
        if response.status_code == 429:
            assert response.json()["quota"] == "calls_per_minute"
            assert 1 <= int(response.headers["Retry-After"]) <= 60
            break
    assert codes[-1] == 429 and codes.count(404) >= 3, codes


def test_output_bytes_per_hour(stack: StackInfo, agent: Agent) -> None:
    tenant_cli(stack, "set", agent.tenant, "--output-bytes-per-hour", "1000")
    for _ in range(2):  # the hour may turn once between the calls: then the second try is refused
        hour = int(time.time()) // 3600
        result = agent.shell("head -c 2000 /dev/zero").json()["result"]
        assert result["stdout_bytes"] == 2000
        wait_for(lambda: int(stack.redis.get(keys.output_bytes(agent.tenant, hour)) or 0) >= 2000
                 or int(time.time()) // 3600 != hour, "the output to be counted")
        refused = agent.call("read_file", {"path": "x"})
        if refused.status_code == 429:
            break
    assert refused.status_code == 429 and refused.json()["quota"] == "output_bytes_per_hour"
    assert 1 <= int(refused.headers["Retry-After"]) <= 3600


@pytest.mark.parametrize("argument", ["--max-running=-1", "--nope=3"])
def test_tenant_set_refuses_bad_values(stack: StackInfo, argument: str) -> None:
    done = subprocess.run([sys.executable, "-m", "runwarden.cli", "tenant", "set", "acme", argument],
                          env=stack.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr


def started_ms(stack: StackInfo, task_id: str) -> int:
    return int(stack.redis.hget(keys.task(task_id), "started_ms") or 0)


def test_a_tenants_backlog_delays_another_by_at_most_one_call_per_pool_process(stack: StackInfo) -> None:
    """Tenant A fills the pool and queues a backlog; tenant B's one call must start before all but
    at most one of A's waiting calls per pool process (FIFO would start it after all of them)."""
    a = Agent(stack, f"ta{uuid.uuid4().hex[:8]}", "r1", ["shell:exec", "files:write"], ["**"])
    b = Agent(stack, f"tb{uuid.uuid4().hex[:8]}", "r1", ["shell:exec"], ["**"])
    running = [a.shell(BLOCKED, wait=None, timeout_ms=60000).json()["task_id"] for _ in range(2)]
    wait_for(lambda: all(a.get(t).json()["status"] == "running" for t in running), "A to fill the pool")
    backlog = [a.shell("echo a", wait=None).json()["task_id"] for _ in range(10)]
    theirs = b.shell("echo b", wait=None).json()["task_id"]
    assert b.get(theirs).json()["status"] == "queued"
    release(a)
    for task_id in [*running, *backlog, theirs]:
        wait_for(lambda: (b if task_id == theirs else a).get(task_id).json()["status"] == "completed", task_id)
    ahead = sum(started_ms(stack, t) < started_ms(stack, theirs) for t in backlog)
    pool_processes = 2  # the session's worker: `--concurrency 2`
    assert ahead <= pool_processes, ahead
    assert stack.redis.scard(keys.inflight(keys.SHELL_QUEUE)) <= pool_processes


def test_a_queue_slot_lost_to_a_crash_comes_back(stack: StackInfo) -> None:
    """A call given to the shell queue whose message a crash lost (its claim's reply never came
    back, say) stays queued: the workers' heal takes its slot back, or the queue would shrink."""
    ghost = f"ghost-{uuid.uuid4()}"
    stack.redis.hset(keys.task(ghost), mapping={"status": "queued", "dispatched_ms": int(time.time() * 1000) - 120_000})
    stack.redis.expire(keys.task(ghost), 600)
    stack.redis.sadd(keys.inflight(keys.SHELL_QUEUE), ghost)
    wait_for(lambda: not stack.redis.sismember(keys.inflight(keys.SHELL_QUEUE), ghost), "the heal to free the slot")
