"""WebSocket handshake refusals are plain HTTP errors (never a 101), checked before the upgrade."""
from __future__ import annotations

import base64
import http.client
import json
import time
import uuid
from urllib.parse import urlsplit

import jwt
import pytest
import websocket

from tests.streams import collect, connect

UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
}


def handshake(stack, path: str,  # type: ignore[no-untyped-def]
              headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
    """Send a raw upgrade request; the status, headers and (for a refusal) body."""
    url = urlsplit(stack.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request("GET", path, headers={**UPGRADE, **headers})
        response = connection.getresponse()
        body = "" if response.status == 101 else response.read().decode(errors="replace")
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        connection.close()


def stream_path(task_id: str, query: str = "") -> str:
    return f"/v1/tool-calls/{task_id}/stream" + (f"?{query}" if query else "")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def shell_task(stack):  # type: ignore[no-untyped-def]
    """A finished shell call of one agent (its stream stays replayable)."""
    from tests.conftest import ALL_SCOPES, Agent
    owner = Agent(stack, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])
    body = owner.shell("echo streamed", wait=30).json()
    assert body["status"] == "completed", body["result"]
    return owner, body["task_id"]


def assert_refused(status: int, headers: dict[str, str], body: str, expected: int, code: str | None = None) -> None:
    assert status == expected and status != 101, (status, body)
    assert headers.get("content-type") == "application/problem+json", headers
    assert "upgrade" not in headers.get("connection", "").lower()
    if code:
        assert json.loads(body)["code"] == code, body


def test_valid_handshake_upgrades(shell_task) -> None:
    owner, task_id = shell_task
    status, headers, _ = handshake(owner.stack, stream_path(task_id), bearer(owner.token))
    assert status == 101
    assert headers["upgrade"].lower() == "websocket"


def test_no_token_is_401(shell_task) -> None:
    owner, task_id = shell_task
    status, headers, body = handshake(owner.stack, stream_path(task_id), {})
    assert_refused(status, headers, body, 401, "unauthorized")
    assert "www-authenticate" in headers


def expired_token(owner) -> str:  # type: ignore[no-untyped-def]
    claims = jwt.decode(owner.token, options={"verify_signature": False})
    claims.update(iat=int(time.time()) - 100, exp=int(time.time()) - 10)
    return "Bearer " + jwt.encode(claims, owner.stack.secret.encode(), algorithm="HS256")


@pytest.mark.parametrize("authorization, code", [
    (lambda owner: "Bearer garbage", "unauthorized"),
    (lambda owner: "Bearer ", "unauthorized"),
    (lambda owner: "Basic Zm9vOmJhcg==", "unauthorized"),
    (expired_token, "token_expired"),
], ids=["garbage", "empty", "basic", "expired"])
def test_bad_token_is_401(shell_task, authorization, code: str) -> None:  # type: ignore[no-untyped-def]
    owner, task_id = shell_task
    status, headers, body = handshake(owner.stack, stream_path(task_id), {"Authorization": authorization(owner)})
    assert_refused(status, headers, body, 401, code)


def test_forged_token_is_401(shell_task) -> None:
    owner, task_id = shell_task
    claims = jwt.decode(owner.token, options={"verify_signature": False})
    forged = jwt.encode(claims, b"z" * 48, algorithm="HS256")
    status, headers, body = handshake(owner.stack, stream_path(task_id), bearer(forged))
    assert_refused(status, headers, body, 401)
    assert owner.stack.secret not in body


def test_token_in_the_url_is_not_accepted(shell_task) -> None:
    owner, task_id = shell_task
    for name in ("access_token", "token", "bearer"):
        status, headers, body = handshake(owner.stack, stream_path(task_id, f"{name}={owner.token}"), {})
        assert_refused(status, headers, body, 401)


def test_bad_bearer_subprotocol_is_401(shell_task) -> None:
    owner, task_id = shell_task
    status, headers, body = handshake(owner.stack, stream_path(task_id),
                                      {"Sec-WebSocket-Protocol": "bearer.not-a-token, runwarden.v1"})
    assert_refused(status, headers, body, 401)


def test_other_tenants_task_is_404(shell_task, make_agent) -> None:
    owner, task_id = shell_task
    intruder = make_agent()
    status, headers, body = handshake(owner.stack, stream_path(task_id), bearer(intruder.token))
    assert_refused(status, headers, body, 404, "not_found")
    assert "streamed" not in body


def test_other_run_of_the_same_tenant_is_404(shell_task, make_agent) -> None:
    owner, task_id = shell_task
    sibling = make_agent(tenant=owner.tenant)
    status, headers, body = handshake(owner.stack, stream_path(task_id), bearer(sibling.token))
    assert_refused(status, headers, body, 404, "not_found")


@pytest.mark.parametrize("task_id", [str(uuid.uuid4()), "x" * 65, "..", "%2e%2e", "a" * 3000])
def test_unknown_task_is_404(shell_task, task_id: str) -> None:
    owner, _ = shell_task
    status, headers, body = handshake(owner.stack, stream_path(task_id), bearer(owner.token))
    assert status == 404 and status != 101, (status, body)


def test_file_task_has_no_stream(shell_task) -> None:
    owner, _ = shell_task
    read = owner.call("read_file", {"path": "missing.txt"})
    assert read.status_code == 404 and read.json()["code"] == "file_not_found"
    status, headers, body = handshake(owner.stack, stream_path(read.json()["task_id"]), bearer(owner.token))
    assert_refused(status, headers, body, 404, "not_found")


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1"])
def test_foreign_origin_is_403(shell_task, origin: str) -> None:
    owner, task_id = shell_task
    status, headers, body = handshake(owner.stack, stream_path(task_id), {**bearer(owner.token), "Origin": origin})
    assert_refused(status, headers, body, 403)


def test_token_without_shell_scope_is_403(shell_task, make_agent) -> None:
    owner, task_id = shell_task
    reader = make_agent(scopes=["files:read", "files:write"], tenant=owner.tenant, run_id=owner.run_id)
    status, headers, body = handshake(owner.stack, stream_path(task_id), bearer(reader.token))
    assert_refused(status, headers, body, 403, "forbidden_scope")


@pytest.mark.parametrize("after_seq", ["-1", "abc", "1.5", "", "99999999999999999999", "1e3"])
def test_bad_after_seq_is_400(shell_task, after_seq: str) -> None:
    owner, task_id = shell_task
    status, headers, body = handshake(owner.stack, stream_path(task_id, f"after_seq={after_seq}"),
                                      bearer(owner.token))
    assert_refused(status, headers, body, 400, "schema_invalid")


def test_browser_subprotocol_form(shell_task) -> None:
    owner, task_id = shell_task
    ws = connect(owner, task_id, subprotocol=True, timeout=30)
    try:
        assert ws.getsubprotocol() == "runwarden.v1"
        received = collect(ws)
    finally:
        ws.close()
    assert received.bytes_of("stdout") == b"streamed\n"
    assert received.exit["exit_code"] == 0 and received.close_code == 1000


def test_browser_form_with_a_foreign_origin_is_refused(shell_task) -> None:
    owner, task_id = shell_task
    url = f"{owner.stack.ws_base}{stream_path(task_id)}"
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(url, subprotocols=[f"bearer.{owner.token}", "runwarden.v1"], timeout=15,
                                    origin="https://evil.example")
    assert info.value.status_code == 403


def test_token_expiring_during_the_stream_closes_it(make_agent) -> None:
    keeper = make_agent()
    response = keeper.shell("echo begin; sleep 50", wait=None)
    assert response.status_code == 202, response.text
    task_id = response.json()["task_id"]
    try:
        # Minted just before the handshake, so even a slow machine opens the stream in time.
        short = make_agent(scopes=["shell:exec"], ttl_s=4, tenant=keeper.tenant, run_id=keeper.run_id)
        ws = connect(short, task_id, timeout=60)
        try:
            received = collect(ws)
        finally:
            ws.close()
        assert received.close_code == 1008, received
        assert not any(event["type"] == "exit" for event in received.events)  # the call ran on: it was the token
        claims = jwt.decode(short.token, options={"verify_signature": False})
        assert time.time() >= claims["exp"] - 0.5  # it closed because the token ran out, not earlier
        assert keeper.get(task_id).json()["status"] == "running"
    finally:
        keeper.http.delete(f"{keeper.stack.base_url}/v1/tool-calls/{task_id}",
                           headers={"Authorization": f"Bearer {keeper.token}"}, timeout=30)


# An expired token cannot open a stream: test_bad_token_is_401[expired].


def test_handshake_error_bodies_leak_nothing(shell_task) -> None:
    owner, task_id = shell_task
    status, _, body = handshake(owner.stack, stream_path(task_id), {"Authorization": "Bearer " + "e" * 100})
    assert status == 401
    for secret in (owner.stack.secret, str(owner.stack.workspaces), "Traceback"):
        assert secret not in body
    assert base64.b64encode(owner.stack.secret.encode()).decode() not in body
