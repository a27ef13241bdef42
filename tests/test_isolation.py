"""No endpoint returns or accepts another tenant's (or another run's) data: tasks, streams,
model-native calls, MCP, quotas and revocations (docs/TENANCY.md lists the boundaries)."""
from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import requests
import websocket

from shared import keys
from tests.conftest import ALL_SCOPES, Agent, StackInfo
from tests.streams import connect


@pytest.fixture
def pair(stack: StackInfo) -> tuple[Agent, Agent]:
    """Two tenants, and the second one also uses the first one's run id."""
    run_id = f"r{uuid.uuid4().hex[:8]}"
    return (Agent(stack, f"ta{uuid.uuid4().hex[:8]}", run_id, ALL_SCOPES, ["**"]),
            Agent(stack, f"tb{uuid.uuid4().hex[:8]}", run_id, ALL_SCOPES, ["**"]))


def test_the_same_key_is_two_calls_for_two_tenants(pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    a.write("secret.txt", b"a's secret\n")
    key, call_id = uuid.uuid4().hex, str(uuid.uuid4())
    mine = a.call("read_file", {"path": "secret.txt"}, key=key, call_id=call_id)
    theirs = b.call("read_file", {"path": "secret.txt"}, key=key, call_id=call_id)
    assert mine.status_code == 200 and theirs.status_code == 404  # b's own (empty) workspace
    assert "Idempotent-Replayed" not in theirs.headers and b"a's secret" not in theirs.content
    assert mine.json()["task_id"] != theirs.json()["task_id"]


@pytest.mark.parametrize("reader", ["other tenant", "same tenant, other run"])
def test_tasks_and_streams_of_others_are_404(stack: StackInfo, pair: tuple[Agent, Agent], reader: str) -> None:
    a, b = pair
    other = b if reader == "other tenant" else Agent(stack, a.tenant, f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])
    task_id = a.shell("echo a-output", wait=30).json()["task_id"]
    assert other.get(task_id).status_code == 404
    deleted = other.http.delete(f"{stack.base_url}/v1/tool-calls/{task_id}",
                                headers={"Authorization": f"Bearer {other.token}"}, timeout=30)
    assert deleted.status_code == 404 and b"a-output" not in deleted.content
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        connect(other, task_id)
    assert refused.value.status_code == 404


def test_model_native_ids_are_per_tenant(pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex}", "name": "execute_shell_command",
             "input": {"command": "echo $RANDOM$RANDOM > out; cat out"}}
    answers = [agent.http.post(f"{agent.stack.base_url}/v1/tool-use", data=json.dumps(block), timeout=60,
                               headers={"Authorization": f"Bearer {agent.token}", "Content-Type": "application/json"})
               for agent in (a, b)]
    texts = [answer.json()["content"][0]["text"] for answer in answers]
    assert (a.workspace / "out").read_text() == texts[0] and (b.workspace / "out").read_text() == texts[1]


def mcp_call(agent: Agent, method: str, params: dict[str, Any]) -> requests.Response:
    return agent.http.post(f"{agent.stack.base_url}/mcp", timeout=60, json={
        "jsonrpc": "2.0", "id": 1, "method": method, "params": params}, headers={
        "Authorization": f"Bearer {agent.token}", "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25"})


def test_mcp_reads_only_the_callers_workspace(pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    a.write("only-a.txt", b"a\n")
    answer = mcp_call(b, "tools/call", {"name": "read_file", "arguments": {"path": "only-a.txt"}})
    result = answer.json()["result"]
    assert result["isError"] is True and "file_not_found" in result["content"][0]["text"]


def test_quota_state_is_per_tenant(stack: StackInfo, pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    stack.redis.hset(keys.tenant_quotas(a.tenant), "max_running", 1)
    stack.redis.sadd(keys.tenant_active(a.tenant), "placeholder-call")  # a's one slot taken
    try:
        refused = a.call("read_file", {"path": "x"})
        assert refused.status_code == 429 and refused.json()["quota"] == "max_running"
        assert b.call("read_file", {"path": "x"}).status_code == 404  # b is not affected
    finally:
        stack.redis.srem(keys.tenant_active(a.tenant), "placeholder-call")
