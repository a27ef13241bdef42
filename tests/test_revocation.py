"""Revocation that bites (contract section 10): the admin endpoint and the CLI; a stream opened with
a revoked token is closed with 4401 while its call runs on; tenants cannot revoke each other."""
from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import jwt
import requests

from tests.conftest import Agent, StackInfo
from tests.streams import collect, connect

HELD = "echo started; until [ -e go ]; do sleep 0.02; done; echo finished"


def jti_of(agent: Agent) -> str:
    return str(jwt.decode(agent.token, options={"verify_signature": False})["jti"])


def revoke(admin: Agent, jti: Any) -> requests.Response:
    return admin.http.post(f"{admin.stack.base_url}/v1/admin/revocations", json={"jti": jti},
                           headers={"Authorization": f"Bearer {admin.token}"}, timeout=30)


def wait_status(agent: Agent, task_id: str, status: str) -> None:
    deadline = time.monotonic() + 60
    while agent.get(task_id).json()["status"] != status:
        assert time.monotonic() < deadline, f"{task_id} never became {status}"
        time.sleep(0.05)


def test_revoked_token_closes_its_stream_4401_and_the_call_runs_on(stack: StackInfo, make_agent: Any) -> None:
    watcher = make_agent()
    same_run = Agent(stack, watcher.tenant, watcher.run_id, ["shell:exec"], ["**"])
    admin = Agent(stack, watcher.tenant, "ops", ["tenant:admin"], ["**"])
    task_id = watcher.shell(HELD, wait=None, timeout_ms=60000).json()["task_id"]
    ws = connect(watcher, task_id)
    try:
        assert collect(ws, limit=1).events[0]["data"] == "started\n"
        answer = revoke(admin, jti_of(watcher))
        assert answer.status_code == 200 and answer.json()["revoked"] is True
        rest = collect(ws)  # the server closes it (the socket's own timeout bounds the wait)
    finally:
        ws.close()
    assert rest.close_code == 4401 and not any(e["type"] == "exit" for e in rest.events)
    assert watcher.get(task_id).status_code == 401
    # The call itself goes on; another token of the run still sees it to its end.
    assert same_run.get(task_id).json()["status"] == "running"
    (watcher.workspace / "go").write_bytes(b"")
    wait_status(same_run, task_id, "completed")
    other = connect(same_run, task_id)
    try:
        assert b"finished\n" in collect(other).bytes_of("stdout")
    finally:
        other.close()


def test_a_revoked_token_cannot_open_a_stream_or_call(stack: StackInfo, make_agent: Any) -> None:
    agent = make_agent()
    task_id = agent.shell("echo hi", wait=30).json()["task_id"]
    admin = Agent(stack, agent.tenant, "ops", ["tenant:admin"], ["**"])
    assert revoke(admin, jti_of(agent)).status_code == 200
    assert revoke(admin, jti_of(agent)).status_code == 200  # idempotent
    assert agent.shell("echo again").status_code == 401
    handshake = requests.get(f"{stack.base_url}/v1/tool-calls/{task_id}/stream", timeout=30, headers={
        "Authorization": f"Bearer {agent.token}", "Connection": "Upgrade", "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert handshake.status_code == 401


def test_an_admin_revokes_only_its_own_tenants_tokens(stack: StackInfo, make_agent: Any) -> None:
    victim = make_agent()
    intruder = Agent(stack, "t-intruder", "ops", ["tenant:admin"], ["**"])
    assert revoke(intruder, jti_of(victim)).status_code == 200  # says nothing of other tenants
    assert victim.shell("echo still mine").json()["result"]["stdout"] == "still mine\n"


def test_revocation_needs_the_admin_scope_and_a_jti(stack: StackInfo, make_agent: Any) -> None:
    agent = make_agent()
    answer = revoke(agent, jti_of(agent))
    assert answer.status_code == 403 and answer.json()["code"] == "forbidden_scope"
    admin = Agent(stack, agent.tenant, "ops", ["tenant:admin"], ["**"])
    for bad in (None, 5, "", "x" * 257):
        answer = revoke(admin, bad)
        assert answer.status_code == 400 and answer.json()["code"] == "schema_invalid", bad
    assert agent.shell("echo fine").status_code == 200


def test_cli_revoke_applies_to_every_tenant(stack: StackInfo, make_agent: Any) -> None:
    agent = make_agent()
    subprocess.run([sys.executable, "-m", "runwarden.cli", "token", "revoke", jti_of(agent)], env=stack.env,
                   check=True, capture_output=True, timeout=60)
    assert agent.shell("echo no").status_code == 401
