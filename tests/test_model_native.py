"""`POST /v1/tool-use` and `POST /v1/openai/tool-calls` (contract section 8), against the real stack.

Blocks are built, and answers parsed, with the official `anthropic` and `openai` SDKs' own types
(no network, no API key): what a platform forwards from its model and hands back to it.
"""
from __future__ import annotations

import base64
import hashlib
import json
import uuid
from typing import Any

import pytest
import requests
from anthropic.types import ToolResultBlockParam, ToolUseBlock
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionToolMessageParam
from pydantic import TypeAdapter

from tests.conftest import Agent

TOOL_RESULT = TypeAdapter(ToolResultBlockParam)
TOOL_MESSAGE = TypeAdapter(ChatCompletionToolMessageParam)


def tool_use(name: str, arguments: dict[str, Any], block_id: str | None = None) -> dict[str, Any]:
    block = ToolUseBlock(id=block_id or f"toolu_{uuid.uuid4().hex}", name=name, input=arguments, type="tool_use")
    return block.model_dump(exclude_none=True)


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    call = ChatCompletionMessageFunctionToolCall.model_validate(
        {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": name, "arguments": arguments}})
    return call.model_dump()


def post(agent: Agent, path: str, body: Any, **headers: str) -> requests.Response:
    sent = {"Authorization": f"Bearer {agent.token}", "Content-Type": "application/json", **headers}
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return agent.http.post(f"{agent.stack.base_url}{path}", data=raw, headers=sent, timeout=120)


def results(response: requests.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    body = response.json()
    answers = body if isinstance(body, list) else [body]
    for answer in answers:
        TOOL_RESULT.validate_python(answer)
    return answers


def texts(result: dict[str, Any]) -> list[str]:
    assert all(block["type"] == "text" for block in result["content"])
    return [block["text"] for block in result["content"]]


def test_read_file_keeps_every_byte_and_names_the_sha(agent: Agent) -> None:
    data = "line one\r\n\tindented \\n not an escape\n\u00e9t\u00e9 \u2603\n".encode()
    sha = agent.write("notes.txt", data)
    block = tool_use("read_file", {"path": "notes.txt"})
    [result] = results(post(agent, "/v1/tool-use", block))
    assert result["tool_use_id"] == block["id"] and result["is_error"] is False
    content = texts(result)
    assert content[0].encode() == data
    assert sha in content[-1]


def test_a_turns_blocks_run_concurrently_and_answer_in_order(agent: Agent) -> None:
    # The first block waits for a file only the second creates: run one after the other, it would time out.
    waiter = tool_use("execute_shell_command", {"command": "until [ -e go ]; do sleep 0.02; done; echo went",
                                                "timeout_ms": 50000})
    starter = tool_use("execute_shell_command", {"command": "touch go; echo started"})
    reader = tool_use("read_file", {"path": "missing.txt"})
    answers = results(post(agent, "/v1/tool-use", [waiter, starter, reader]))
    assert [a["tool_use_id"] for a in answers] == [waiter["id"], starter["id"], reader["id"]]
    assert texts(answers[0])[0] == "went\n" and answers[0]["is_error"] is False
    assert texts(answers[1])[0] == "started\n"
    assert answers[2]["is_error"] is True and "file_not_found" in texts(answers[2])[0]


def test_shell_output_streams_separately_with_exit_code_and_error_flag(agent: Agent) -> None:
    block = tool_use("execute_shell_command", {"command": "printf 'a\\r\\n\\tb\\\\n'; printf 'oops\\n' >&2; exit 3"})
    [result] = results(post(agent, "/v1/tool-use", block))
    content = texts(result)
    assert content[:2] == ["a\r\n\tb\\n", "oops\n"]
    assert "exit code 3" in content[-1] and result["is_error"] is True


def test_output_that_is_not_utf8_travels_as_base64_with_a_note(agent: Agent) -> None:
    raw = b"\xff\xfe ok \xc3"
    block = tool_use("execute_shell_command", {"command": "printf '\\377\\376 ok \\303'"})
    [result] = results(post(agent, "/v1/tool-use", block))
    content = texts(result)
    assert base64.b64decode(content[0]) == raw
    assert "base64" in content[-1] and result["is_error"] is False


def test_long_output_says_what_was_kept_and_where_the_rest_is(agent: Agent) -> None:
    size = 1_500_000  # past the HTTP copy (RUNWARDEN_HTTP_OUTPUT_BYTES, 1 MiB)
    block = tool_use("execute_shell_command", {"command": f"head -c {size} /dev/zero | tr '\\0' x"})
    [result] = results(post(agent, "/v1/tool-use", block))
    content = texts(result)
    assert set(content[0]) == {"x"} and 0 < len(content[0]) < size
    status = content[-1]
    assert str(size) in status and "/stream" in status and "task_id" in status
    shown = agent.get(status.split("task_id ")[1].split(",")[0]).json()
    assert shown["result"]["stdout_bytes"] == size
    assert shown["result"]["stdout_sha256"] == hashlib.sha256(b"x" * size).hexdigest()


def test_stale_patch_is_an_error_the_model_can_act_on(agent: Agent) -> None:
    current = agent.write("a.txt", b"one\n")
    diff = "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-one\n+two\n"
    block = tool_use("apply_file_patch", {"path": "a.txt", "diff": diff, "base_sha": "1" * 40})
    [result] = results(post(agent, "/v1/tool-use", block))
    [text] = texts(result)
    assert result["is_error"] is True and current in text and "read the file again" in text.lower()
    assert (agent.workspace / "a.txt").read_bytes() == b"one\n"


def test_a_retried_block_never_runs_twice(agent: Agent) -> None:
    block = tool_use("execute_shell_command", {"command": "echo ran >> runs.log; wc -l < runs.log"})
    first = post(agent, "/v1/tool-use", block)
    second = post(agent, "/v1/tool-use", block)
    assert results(first) == results(second)
    assert (agent.workspace / "runs.log").read_bytes() == b"ran\n"


def test_openai_tool_calls_answer_tool_messages(agent: Agent) -> None:
    agent.write("x.txt", b"hi\r\n")
    calls = [tool_call("read_file", json.dumps({"path": "x.txt"})),
             tool_call("execute_shell_command", json.dumps({"command": "echo out; exit 1"})),
             tool_call("read_file", "{not json"),
             tool_call("no_such_tool", "{}")]
    response = post(agent, "/v1/openai/tool-calls", calls)
    assert response.status_code == 200, response.text
    answers = response.json()
    for answer in answers:
        TOOL_MESSAGE.validate_python(answer)
    assert [a["tool_call_id"] for a in answers] == [c["id"] for c in calls]
    assert answers[0]["content"].startswith("hi\r\n")
    assert "out\n" in answers[1]["content"] and "exit code 1" in answers[1]["content"]
    assert "not valid JSON" in answers[2]["content"]
    assert "schema_invalid" in answers[3]["content"]


def test_a_scope_the_token_lacks_refuses_the_whole_turn_and_runs_nothing(make_agent: Any) -> None:
    agent = make_agent(scopes=["files:read"])
    blocks = [tool_use("read_file", {"path": "x"}), tool_use("execute_shell_command", {"command": "touch ran"})]
    response = post(agent, "/v1/tool-use", blocks)
    assert response.status_code == 403 and response.json()["code"] == "forbidden_scope"
    assert response.headers["Content-Type"] == "application/problem+json"
    assert not (agent.workspace / "ran").exists()


def test_path_outside_the_grant_is_an_error_result(make_agent: Any) -> None:
    agent = make_agent(paths=["docs/**"])
    [result] = results(post(agent, "/v1/tool-use", tool_use("read_file", {"path": "secret.txt"})))
    assert result["is_error"] is True and "path_forbidden" in texts(result)[0]


@pytest.mark.parametrize("body, pointer", [
    (b"{not json", ""),
    ([], ""),
    ([{"type": "tool_use", "id": f"toolu_{i}", "name": "read_file", "input": {"path": "x"}} for i in range(65)], ""),
    ({"type": "tool_use", "id": 5, "name": "read_file", "input": {"path": "x"}}, "/id"),
    ({"type": "text", "text": "hello"}, "/type"),
    ([{"type": "tool_use", "id": "same", "name": "read_file", "input": {"path": "x"}}] * 2, ""),
    ("[1, 2]", "/0/type"),
])
def test_shapeless_bodies_are_problems_and_run_nothing(agent: Agent, body: Any, pointer: str) -> None:
    response = post(agent, "/v1/tool-use", body)
    assert response.status_code == 400, response.text
    problem = response.json()
    assert response.headers["Content-Type"] == "application/problem+json"
    assert problem["code"] == "schema_invalid" and problem["errors"][0]["pointer"] == pointer


@pytest.mark.parametrize("entry", [
    {"id": "call_1", "type": "function", "function": "read_file"},
    {"id": ["call_1"], "type": "function", "function": {"name": "read_file", "arguments": "{}"}},
    {"id": "call_1", "type": "custom", "function": {"name": "read_file", "arguments": "{}"}},
])
def test_openai_shapeless_entries_are_problems(agent: Agent, entry: dict[str, Any]) -> None:
    response = post(agent, "/v1/openai/tool-calls", entry)
    assert response.status_code == 400 and response.json()["code"] == "schema_invalid"


def test_arguments_that_are_not_a_string_are_an_error_result(agent: Agent) -> None:
    entry = {"id": "call_obj", "type": "function", "function": {"name": "read_file", "arguments": {"path": "x"}}}
    response = post(agent, "/v1/openai/tool-calls", entry)
    assert response.status_code == 200 and "arguments must be a string" in response.json()["content"]


def test_no_token_is_401(agent: Agent) -> None:
    response = requests.post(f"{agent.stack.base_url}/v1/tool-use", json=tool_use("read_file", {"path": "x"}),
                             timeout=30)
    assert response.status_code == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
