"""`POST /mcp` (contract section 9) against the real stack.

Most tests drive it with the official MCP Python SDK's client (`mcp` on PyPI), in both connect
modes: `legacy` (the initialize handshake) and `auto` (it probes `server/discover` first and must
fall back to initialize). The rest are raw HTTP checks of the transport: no session, 401 and 403,
405, and JSON-RPC errors (never a 500) for whatever the body holds.
"""
from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx2
import mcp_types as mt
import pytest
import requests
from jsonschema import Draft202012Validator
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client

from shared import keys
from shared.schema import TOOLS
from tests.conftest import Agent

MODES = ["legacy", "auto"]
TASK_ID = "runwarden.dev/task_id"


@asynccontextmanager
async def connect(agent: Agent, mode: str, **headers: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {agent.token}", **headers},
                              timeout=httpx2.Timeout(30, read=120))
    async with http, Client(streamable_http_client(f"{agent.stack.base_url}/mcp", http_client=http),
                            mode=mode) as client:  # type: ignore[arg-type]
        yield client


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 45) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def post(agent: Agent, body: Any, *, token: str | None = "", **headers: str) -> requests.Response:
    """One raw POST /mcp, as an MCP client sends it: with the agent's token, or `token` (None: none)."""
    sent = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream", **headers}
    if token is not None:
        sent["Authorization"] = f"Bearer {token or agent.token}"
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{agent.stack.base_url}/mcp", data=raw, headers=sent, timeout=120)


def rpc(method: str, params: dict[str, Any] | None = None, request_id: Any = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, **({"params": params} if params else {})}


def error_of(response: requests.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert body["jsonrpc"] == "2.0" and "result" not in body, body
    return body


def sse_messages(response: requests.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an SSE answer, in order (comments skipped)."""
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return [json.loads(line[len("data: "):]) for line in response.text.split("\n") if line.startswith("data: ")]


# --- with the official SDK client ------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_tools_follow_the_token_with_schemas_and_annotations(make_agent, mode: str) -> None:  # type: ignore[no-untyped-def]
    async def listed(agent: Agent) -> tuple[str, dict[str, mt.Tool]]:
        async with connect(agent, mode) as client:
            tools = await client.list_tools()
            return client.protocol_version, {tool.name: tool for tool in tools.tools}

    version, tools = anyio.run(listed, make_agent())
    assert version == "2025-11-25"
    assert set(tools) == set(TOOLS)
    for name, tool in tools.items():
        assert tool.input_schema == TOOLS[name].parameters and tool.output_schema == TOOLS[name].result
        Draft202012Validator.check_schema(tool.output_schema)
    assert tools["read_file"].annotations.read_only_hint is True  # type: ignore[union-attr]
    for name in ("apply_file_patch", "execute_shell_command"):
        assert tools[name].annotations.destructive_hint is True  # type: ignore[union-attr]
        assert tools[name].annotations.read_only_hint is False  # type: ignore[union-attr]
    assert tools["apply_file_patch"].annotations.idempotent_hint is True  # type: ignore[union-attr]
    assert not tools["execute_shell_command"].annotations.idempotent_hint  # type: ignore[union-attr]
    assert "60 s" in tools["execute_shell_command"].description  # type: ignore[operator]

    _, read_only = anyio.run(listed, make_agent(scopes=["files:read"]))
    assert set(read_only) == {"read_file"}


@pytest.mark.parametrize("mode", MODES)
def test_read_file_structured_content_is_the_rest_result(agent: Agent, mode: str) -> None:
    data = "crlf\r\n\ttab, trailing space \nunicode \u00e9t\u00e9 \u2603 \U0001f600\n\\n not an escape".encode()
    sha = agent.write("notes.txt", data)

    async def read() -> mt.CallToolResult:
        async with connect(agent, mode) as client:
            return await client.call_tool("read_file", {"path": "notes.txt"})

    result = anyio.run(read)
    assert result.is_error is False
    rest = agent.get(result.meta[TASK_ID]).json()  # type: ignore[index]
    assert rest["status"] == "completed" and result.structured_content == rest["result"]
    assert result.structured_content["content"].encode() == data and result.structured_content["sha"] == sha
    texts = [block.text for block in result.content]  # type: ignore[union-attr]
    assert texts[0].encode() == data and sha in texts[-1]


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_patch_is_an_error_result_naming_the_current_sha(agent: Agent, mode: str) -> None:
    old_sha = agent.write("app.py", b"x = 1\n")
    diff = "--- a/app.py\n+++ b/app.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"

    async def patch_twice() -> tuple[mt.CallToolResult, mt.CallToolResult]:
        async with connect(agent, mode) as client:
            arguments = {"path": "app.py", "diff": diff, "base_sha": old_sha}
            return await client.call_tool("apply_file_patch", arguments), \
                await client.call_tool("apply_file_patch", arguments)

    applied, stale = anyio.run(patch_twice)
    assert applied.is_error is False and (agent.workspace / "app.py").read_bytes() == b"x = 2\n"
    new_sha = applied.structured_content["new_sha"]  # type: ignore[index]
    assert stale.is_error is True
    assert stale.structured_content == agent.get(stale.meta[TASK_ID]).json()["result"]  # type: ignore[index]
    assert stale.structured_content["code"] == "base_sha_mismatch"  # type: ignore[index]
    text = " ".join(block.text for block in stale.content)  # type: ignore[union-attr]
    assert new_sha in text and "Read the file again" in text


@pytest.mark.parametrize("mode", MODES)
def test_shell_output_streams_as_progress_in_order(agent: Agent, mode: str) -> None:
    # The command waits for a file the test creates only once the first chunk has arrived: the
    # chunks come while the command runs, not after it.
    command = ("printf 'first\\r\\n'; until [ -e go ]; do sleep 0.05; done; "
               "for i in 2 3 4; do printf 'line %s\\t\\303\\251\\n' $i; sleep 0.05; done")
    received: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        received.append((progress, message))
        (agent.workspace / "go").touch()

    async def run() -> mt.CallToolResult:
        async with connect(agent, mode) as client:
            return await client.call_tool("execute_shell_command", {"command": command, "timeout_ms": 50000},
                                          progress_callback=on_progress)

    result = anyio.run(run)
    stdout = "first\r\n" + "".join(f"line {i}\t\u00e9\n" for i in (2, 3, 4))
    assert result.is_error is False and result.structured_content["stdout"] == stdout  # type: ignore[index]
    assert "".join(message or "" for _, message in received) == stdout
    progress = [value for value, _ in received]
    assert len(progress) >= 2 and progress == sorted(set(progress))  # strictly increasing
    assert [block.text for block in result.content][0] == stdout  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", MODES)
def test_cancelling_a_call_cancels_it(agent: Agent, mode: str) -> None:
    key = f"mcp-cancel-{uuid.uuid4()}"  # a known key, so the test knows the call's task id
    task_id = keys.task_id_for(agent.tenant, key)

    def ended() -> dict[str, Any]:
        return wait_for(lambda: (body := agent.get(task_id).json())["status"] != "running" and body, "the cancel")

    async def start_then_cancel() -> dict[str, Any]:
        async with connect(agent, mode, **{"Idempotency-Key": key}) as client:
            started = anyio.Event()

            async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                started.set()

            async with anyio.create_task_group() as group:
                group.start_soon(lambda: client.call_tool(
                    "execute_shell_command", {"command": "echo started; sleep 30", "timeout_ms": 50000},
                    progress_callback=on_progress))
                with anyio.fail_after(60):
                    await started.wait()
                group.cancel_scope.cancel()  # the SDK sends notifications/cancelled for the request
            # The session stays open meanwhile, as a host's does (closing it at once may drop the notice).
            return await anyio.to_thread.run_sync(ended)

    view = anyio.run(start_then_cancel)
    assert view["status"] == "cancelled", view
    assert view["result"]["exit_code"] == 128 + 15 or view["result"]["signal"] in ("SIGTERM", "SIGKILL"), view


# --- raw HTTP --------------------------------------------------------------------------------


def test_no_session_is_ever_opened(agent: Agent) -> None:
    url = f"{agent.stack.base_url}/mcp"
    auth = {"Authorization": f"Bearer {agent.token}"}
    answers = [
        post(agent, rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                       "clientInfo": {"name": "t", "version": "1"}})),
        post(agent, {"jsonrpc": "2.0", "method": "notifications/initialized"}),
        post(agent, rpc("tools/list")), post(agent, rpc("ping")), post(agent, b"{"),
        requests.get(url, headers=auth, timeout=30), requests.delete(url, headers=auth, timeout=30),
    ]
    assert [answer.status_code for answer in answers] == [200, 202, 200, 200, 400, 405, 405]
    assert all("Mcp-Session-Id" not in answer.headers for answer in answers)
    assert answers[1].content == b""
    assert all("POST" in answer.headers["Allow"] for answer in answers[5:])


def test_every_method_needs_a_valid_token(agent: Agent) -> None:
    bodies = [rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                 "clientInfo": {"name": "t", "version": "1"}}),
              rpc("tools/list"), rpc("tools/call", {"name": "read_file", "arguments": {"path": "x"}}),
              {"jsonrpc": "2.0", "method": "notifications/initialized"}, b"not json"]
    for body in bodies:
        for token in (None, agent.token[:-4] + "AAAA"):
            answer = post(agent, body, token=token)
            assert answer.status_code == 401, answer.text
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_foreign_origin_is_refused(agent: Agent) -> None:
    """DNS rebinding: a page on another origin reaching a local runwarden through the browser."""
    for body in (rpc("tools/list"), rpc("tools/call", {"name": "read_file", "arguments": {"path": "x"}})):
        answer = post(agent, body, Origin="http://attacker.example")
        assert answer.status_code == 403 and answer.json()["code"] == "forbidden_origin", answer.text
    assert post(agent, rpc("tools/list")).status_code == 200  # no Origin: not a browser


@pytest.mark.parametrize("body, code", [
    (b"{not json", mt.PARSE_ERROR),
    (b"", mt.PARSE_ERROR),
    (b'{"jsonrpc": "2.0", "id": "\\ud800", "method": "ping"}', mt.PARSE_ERROR),  # a lone surrogate
    (b"[" * 100_000 + b"]" * 100_000, mt.PARSE_ERROR),  # nested past the parser's recursion limit
    (b"[]", mt.INVALID_REQUEST),
    (json.dumps([rpc("ping")] * 10_000).encode(), mt.INVALID_REQUEST),  # batches are not in 2025-06-18+
    (b'"ping"', mt.INVALID_REQUEST),
    (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', mt.INVALID_REQUEST),
    (b'{"id": 1, "method": "ping"}', mt.INVALID_REQUEST),
    (b'{"jsonrpc": "2.0", "id": true, "method": "ping"}', mt.INVALID_REQUEST),
    (b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', mt.INVALID_REQUEST),
    (b'{"jsonrpc": "2.0", "id": 1, "method": 5}', mt.INVALID_REQUEST),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1]}', mt.INVALID_REQUEST),
    (b'{"jsonrpc": "2.0", "id": 1}', mt.INVALID_REQUEST),
])
def test_malformed_bodies_are_json_rpc_errors(agent: Agent, body: bytes, code: int) -> None:
    """What the transport cannot accept is a 400 whose body is a JSON-RPC error (as the SDK's own
    server answers, and its client reads): never a 500."""
    answer = error_of(post(agent, body), 400)
    assert answer["error"]["code"] == code


@pytest.mark.parametrize("message, code", [
    (rpc("server/discover"), mt.METHOD_NOT_FOUND),  # the 2026 probe of clients in auto mode
    (rpc("resources/list"), mt.METHOD_NOT_FOUND),
    (rpc("x" * 1_000_000), mt.METHOD_NOT_FOUND),
    (rpc("tools/call", {"arguments": {}}), mt.INVALID_PARAMS),
    (rpc("tools/call", {"name": "read_file", "arguments": [1]}), mt.INVALID_PARAMS),
    (rpc("tools/call", {"name": "rm_rf", "arguments": {}}), mt.INVALID_PARAMS),  # unknown tool
    (rpc("initialize", {"protocolVersion": "2025-11-25"}), mt.INVALID_PARAMS),
    (rpc("tools/list", request_id="s" * 100_000), None),
])
def test_requests_get_json_rpc_answers(agent: Agent, message: dict[str, Any], code: int | None) -> None:
    answer = post(agent, message)
    assert answer.status_code == 200 and answer.json()["id"] == message["id"], answer.text[:300]
    if code is None:
        assert "result" in answer.json()
    else:
        assert error_of(answer)["error"]["code"] == code


def test_notifications_are_accepted_with_no_body(agent: Agent) -> None:
    for method in ("notifications/initialized", "notifications/cancelled", "notifications/whatever"):
        for params in (None, {"requestId": "nothing-running"}, {"requestId": {"odd": True}}):
            answer = post(agent, {"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})})
            assert answer.status_code == 202 and answer.content == b"", answer.text


def test_version_is_negotiated_and_the_header_checked(agent: Agent) -> None:
    for asked, answered in [("2025-11-25", "2025-11-25"), ("2025-06-18", "2025-06-18"),
                            ("2025-03-26", "2025-03-26"), ("2024-11-05", "2025-11-25"), ("2999-01-01", "2025-11-25")]:
        answer = post(agent, rpc("initialize", {"protocolVersion": asked, "capabilities": {},
                                                "clientInfo": {"name": "t", "version": "1"}}))
        assert answer.json()["result"]["protocolVersion"] == answered
        assert answer.json()["result"]["serverInfo"]["name"] == "runwarden"
    for version in ("2025-06-18", "2025-03-26"):
        tools = post(agent, rpc("tools/list"), **{"MCP-Protocol-Version": version}).json()["result"]["tools"]
        assert {tool["name"] for tool in tools} == set(TOOLS)
    refused = error_of(post(agent, rpc("tools/list"), **{"MCP-Protocol-Version": "1999-01-01"}), 400)
    assert refused["error"]["code"] == mt.INVALID_REQUEST
    probe = post(agent, rpc("server/discover"), **{"MCP-Protocol-Version": "2026-07-28"})
    assert error_of(probe)["error"]["code"] == mt.METHOD_NOT_FOUND


def test_refusals_the_model_can_correct_are_error_results(make_agent) -> None:  # type: ignore[no-untyped-def]
    agent = make_agent(paths=["src/**"])
    for arguments, code, pointer in [({"path": 5}, "schema_invalid", "/arguments/path"),
                                     ({"path": "x", "extra": 1}, "schema_invalid", "/arguments"),
                                     ({"path": "../etc/passwd"}, "path_forbidden", None),
                                     ({"path": "docs/secret.txt"}, "path_forbidden", None)]:
        result = post(agent, rpc("tools/call", {"name": "read_file", "arguments": arguments})).json()["result"]
        assert result["isError"] is True and result["structuredContent"]["code"] == code, result
        assert code in result["content"][0]["text"]
        if pointer:
            assert pointer in [error["pointer"] for error in result["structuredContent"]["errors"]]


def test_a_tool_outside_the_tokens_scopes_is_a_json_rpc_error_and_nothing_runs(make_agent) -> None:  # type: ignore[no-untyped-def]
    agent = make_agent(scopes=["files:read"])
    key = f"k-{uuid.uuid4()}"
    answer = post(agent, rpc("tools/call", {"name": "execute_shell_command", "arguments": {"command": "touch x"}}),
                  **{"Idempotency-Key": key})
    error = error_of(answer)["error"]
    assert error["code"] == mt.INVALID_PARAMS and error["data"]["code"] == "forbidden_scope"
    assert agent.get(keys.task_id_for(agent.tenant, key)).status_code == 404


def test_an_idempotency_key_replays_and_without_one_every_call_runs(agent: Agent) -> None:
    call = rpc("tools/call", {"name": "execute_shell_command", "arguments": {"command": "echo x >> runs; wc -l < runs"}})
    key = f"k-{uuid.uuid4()}"
    first, again = (post(agent, call, **{"Idempotency-Key": key}).json()["result"] for _ in range(2))
    assert first["structuredContent"]["stdout"] == "1\n" and again == first
    other = post(agent, rpc("tools/call", {"name": "read_file", "arguments": {"path": "runs"}}),
                 **{"Idempotency-Key": key})
    assert error_of(other)["error"]["data"]["code"] == "idempotency_key_reused"
    # Without the header the same JSON-RPC id (clients count from 1 in every session) is a new call.
    answers = [post(agent, call).json()["result"]["structuredContent"]["stdout"] for _ in range(2)]
    assert answers == ["2\n", "3\n"] and (agent.workspace / "runs").read_bytes() == b"x\nx\nx\n"


def test_progress_over_raw_sse_marks_base64_and_ends_with_the_response(agent: Agent) -> None:
    call = rpc("tools/call", {"name": "execute_shell_command", "_meta": {"progressToken": "tok"},
                              "arguments": {"command": "printf 'ok\\n'; printf '\\377\\376' >&2"}}, request_id="r-1")
    answer = post(agent, call)
    assert answer.status_code == 200, answer.text
    assert answer.headers["Cache-Control"] == "no-cache" and answer.headers["X-Accel-Buffering"] == "no"
    *notes, response = sse_messages(answer)
    assert response["id"] == "r-1" and response["result"]["isError"] is False
    assert all(note["method"] == "notifications/progress" and note["params"]["progressToken"] == "tok"
               for note in notes)
    by_stream = {note["params"]["_meta"]["runwarden.dev/stream"]: note["params"] for note in notes}
    assert by_stream["stdout"]["message"] == "ok\n" and by_stream["stdout"]["_meta"]["runwarden.dev/encoding"] == "utf-8"
    marked = by_stream["stderr"]["message"]
    assert marked.startswith("[base64] ") and base64.b64decode(marked[len("[base64] "):]) == b"\xff\xfe"
    assert by_stream["stderr"]["_meta"]["runwarden.dev/encoding"] == "base64"


def test_without_a_progress_token_the_answer_is_plain_json(agent: Agent) -> None:
    answer = post(agent, rpc("tools/call", {"name": "execute_shell_command", "arguments": {"command": "exit 3"}}))
    assert answer.headers["Content-Type"].startswith("application/json")
    result = answer.json()["result"]
    assert result["isError"] is True and result["structuredContent"]["exit_code"] == 3
    assert "exit code 3" in result["content"][-1]["text"]


def test_cancelled_finds_a_plain_json_call_by_its_request_id(agent: Agent) -> None:
    key = f"k-{uuid.uuid4()}"
    task_id = keys.task_id_for(agent.tenant, key)
    answers: list[requests.Response] = []
    call = rpc("tools/call", {"name": "execute_shell_command", "arguments": {"command": "sleep 30", "timeout_ms": 50000}},
               request_id=7)
    caller = threading.Thread(target=lambda: answers.append(post(agent, call, **{"Idempotency-Key": key})))
    caller.start()
    wait_for(lambda: agent.get(task_id).json().get("status") == "running", "the call's start")
    notice = post(agent, {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}})
    assert notice.status_code == 202
    caller.join(60)
    result = answers[0].json()["result"]
    assert result["isError"] is True and agent.get(task_id).json()["status"] == "cancelled"


def test_odd_inputs_never_answer_500(agent: Agent) -> None:
    oversized = rpc("tools/call", {"name": "read_file", "arguments": {"path": "x" * (3 * 1024 * 1024)}})
    assert post(agent, oversized).status_code == 413
    assert post(agent, rpc("ping"), **{"Content-Type": "text/plain"}).status_code == 415
    bad_key = post(agent, rpc("tools/call", {"name": "read_file", "arguments": {"path": "x"}}),
                   **{"Idempotency-Key": "not a key!"})
    assert bad_key.status_code == 400 and bad_key.json()["code"] == "invalid_idempotency_key"
    for params in ({"name": "read_file", "arguments": {"path": "\u0000"}}, {"name": "read_file", "arguments": None},
                   {"name": "execute_shell_command", "arguments": {"command": "true", "timeout_ms": 10**30}},
                   {"name": "read_file", "arguments": {"path": "a"}, "_meta": {"progressToken": [1]}}):
        answer = post(agent, rpc("tools/call", params))
        assert answer.status_code == 200 and ("error" in answer.json() or answer.json()["result"]["isError"]), \
            answer.text
