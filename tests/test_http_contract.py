"""HTTP contract of POST /v1/tool-calls and the meta routes: status codes, problem+json bodies,
Idempotency-Key rules, schema errors with JSON pointers, size limits, and a small fuzz."""
from __future__ import annotations

import base64
import http.client
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import requests

from shared.celery_app import create_celery
from shared.settings import Settings
from tests.contract import TOOL_PARAMETERS, assert_tool_parameters
from tests.waiting import wait_until
from workers.patching import git_blob_sha

PROBLEM_JSON = "application/problem+json"


def url(stack, path: str = "/v1/tool-calls") -> str:  # type: ignore[no-untyped-def]
    return f"{stack.base_url}{path}"


def envelope(tool_name: str = "read_file", parameters: dict[str, Any] | None = None, **extra: Any) -> dict:
    body = {"tool_name": tool_name, "call_id": str(uuid.uuid4()),
            "parameters": {"path": "missing.txt"} if parameters is None else parameters}
    body.update(extra)
    return body


def post(agent, body: Any, *, key: str | None = None, raw: bytes | str | None = None,  # type: ignore[no-untyped-def]
         **headers: str) -> requests.Response:
    all_headers = agent.headers(key)
    for name, value in headers.items():
        name = name.replace("_", "-")
        if value is None:
            all_headers.pop(name, None)
        else:
            all_headers[name] = value
    data = raw if raw is not None else json.dumps(body)
    return agent.http.post(url(agent.stack), data=data, headers=all_headers, timeout=60)


def assert_problem(response: requests.Response, status: int, code: str | None = None) -> dict:
    """An RFC 9457 body with a code, that leaks no stack trace, host path or secret."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == PROBLEM_JSON, response.headers
    body = response.json()
    assert isinstance(body, dict) and body["status"] == status and body["title"] and body["code"], body
    if code:
        assert body["code"] == code, body
    assert_no_leak(response)
    return body


def assert_no_leak(response: requests.Response) -> None:
    text = response.text
    assert "Traceback" not in text and 'File "' not in text
    stack = LEAK_CONTEXT["stack"]
    for secret in (stack.secret, str(stack.workspaces), "/work/main", urlsplit(stack.redis_url).password or "\x00"):
        assert secret not in text, secret


LEAK_CONTEXT: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _leak_context(stack) -> None:  # type: ignore[no-untyped-def]
    LEAK_CONTEXT["stack"] = stack


def pointers(response: requests.Response) -> list[str]:
    errors = response.json()["errors"]
    assert errors and all(isinstance(e["pointer"], str) and e["message"] for e in errors), errors
    return [e["pointer"] for e in errors]


def assert_key_still_free(agent, key: str) -> None:  # type: ignore[no-untyped-def]
    """A refusal before acceptance records nothing: the same key then runs a good request."""
    response = post(agent, envelope(), key=key)
    assert response.status_code == 404 and response.json()["code"] == "file_not_found", response.text
    assert "Idempotent-Replayed" not in response.headers


# --- Idempotency-Key -------------------------------------------------------------------------------

def test_missing_idempotency_key_is_400(agent) -> None:
    response = post(agent, envelope(), Idempotency_Key=None)
    assert_problem(response, 400, "missing_idempotency_key")


@pytest.mark.parametrize("key", ["", "a" * 256, "a b", "é", "a,b", "a;b", "a/b", "a\tb", '"', '""',
                                 '"abc', 'abc"', "'abc'", "key%20x", "a*"])
def test_invalid_idempotency_key_is_400(agent, key: str) -> None:
    response = post(agent, envelope(), raw=json.dumps(envelope()), **{"Idempotency-Key": key})
    assert_problem(response, 400, "invalid_idempotency_key")


@pytest.mark.parametrize("key", ["a", "A" * 255, "01J9Z3S4Q6X7Y8Z9ABCDEFGHJK", "tenant:call-1.retry_2",
                                 f'"{uuid.uuid4()}"'])
def test_valid_idempotency_keys_are_accepted(agent, key: str) -> None:
    response = post(agent, envelope(), key=key)
    assert response.status_code == 404 and response.json()["code"] == "file_not_found", response.text


# A quoted key is the same key: test_files.py::test_replay_is_byte_identical_and_runs_nothing.


def raw_post(stack, headers: list[tuple[str, str]], body: bytes) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    parts = urlsplit(stack.base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/tool-calls")
        for name, value in headers + [("Content-Length", str(len(body)))]:
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_idempotency_key_sent_twice_is_400(agent) -> None:
    key = uuid.uuid4().hex
    for second in (key, uuid.uuid4().hex):
        status, text = raw_post(agent.stack, [("Authorization", f"Bearer {agent.token}"),
                                              ("Content-Type", "application/json"),
                                              ("Idempotency-Key", key), ("Idempotency-Key", second)],
                                json.dumps(envelope()).encode())
        assert status == 400, text
        assert json.loads(text)["code"] == "invalid_idempotency_key"
    assert_key_still_free(agent, key)


# --- body size, media type, JSON ------------------------------------------------------------------

def oversized_call() -> str:
    return json.dumps(envelope("apply_file_patch", {"path": "big.txt", "base_sha": "0" * 40,
                                                    "diff": "x" * (2 * 1024 * 1024)}))


def test_body_over_two_mib_is_413_and_claims_nothing(agent) -> None:
    key = uuid.uuid4().hex
    response = requests.post(url(agent.stack), data=oversized_call(), headers=agent.headers(key), timeout=60)
    assert_problem(response, 413, "payload_too_large")
    assert not (agent.workspace / "big.txt").exists()
    retry = requests.post(url(agent.stack), data=json.dumps(envelope()), headers=agent.headers(key), timeout=60)
    assert retry.status_code == 404 and retry.json()["code"] == "file_not_found", retry.text
    assert "Idempotent-Replayed" not in retry.headers


def test_connection_stays_usable_after_a_413(agent) -> None:
    """A 413 either closes the connection (Connection: close) or leaves it usable for the retry."""
    for _ in range(20):
        session = requests.Session()
        refused = session.post(url(agent.stack), data=oversized_call(), headers=agent.headers(), timeout=60)
        assert refused.status_code == 413
        if refused.headers.get("Connection", "").lower() == "close":
            continue
        following = session.get(url(agent.stack, "/healthz"), timeout=30)  # raises when the server dropped it
        assert following.status_code == 200
        session.close()


def test_chunked_body_over_the_limit_is_413(agent) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"tool_name":"read_file","call_id":"' + str(uuid.uuid4()).encode() + b'","parameters":{"path":"'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}}'
    response = agent.http.post(url(agent.stack), data=chunks(), headers=agent.headers(), timeout=60)
    assert response.status_code in (413, 400), response.text  # never parsed as a 2.5 MB call
    assert response.headers["Content-Type"] == PROBLEM_JSON
    assert_no_leak(response)


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b'{"tool_name": "read_file",}', b"\xff\xfe{}",
                                 b'{"a":1}{"b":2}', b"[1,2", b"NaN-ish"])
def test_invalid_json_is_400_schema_invalid(agent, raw: bytes) -> None:
    key = uuid.uuid4().hex
    assert_problem(post(agent, None, raw=raw, key=key), 400, "schema_invalid")
    assert_key_still_free(agent, key)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/xml"])
def test_non_json_content_type_is_415(agent, content_type: str) -> None:
    key = uuid.uuid4().hex
    response = post(agent, envelope(), key=key, Content_Type=content_type)
    assert_problem(response, 415)
    assert_key_still_free(agent, key)


def test_json_with_charset_is_accepted(agent) -> None:
    response = post(agent, envelope(), Content_Type="application/json; charset=utf-8")
    assert response.status_code == 404 and response.json()["code"] == "file_not_found", response.text


# --- the schema ------------------------------------------------------------------------------------

SHA = "a" * 40
SCHEMA_CASES: dict[str, tuple[Any, set[str]]] = {
    "unknown_top_level_property": (envelope(extra=1), {"", "/extra"}),
    "unknown_parameter": (envelope(parameters={"path": "a", "bogus": 1}), {"/parameters", "/parameters/bogus"}),
    "call_id_not_a_uuid": (envelope(call_id="not-a-uuid"), {"/call_id"}),
    "call_id_36_chars_not_uuid": (envelope(call_id="z" * 36), {"/call_id"}),
    "call_id_number": (envelope(call_id=12345), {"/call_id"}),
    "tool_name_unknown": (envelope(tool_name="delete_everything"), {"/tool_name"}),
    "tool_name_wrong_case": (envelope(tool_name="READ_FILE"), {"/tool_name"}),
    "read_file_with_shell_parameters": (envelope(parameters={"command": "ls"}), {"/parameters"}),
    "patch_with_shell_parameters": (envelope("apply_file_patch", {"command": "ls", "timeout_ms": 5}),
                                    {"/parameters"}),
    "shell_with_read_parameters": (envelope("execute_shell_command", {"path": "a"}), {"/parameters"}),
    "timeout_ms_zero": (envelope("execute_shell_command", {"command": "true", "timeout_ms": 0}),
                        {"/parameters/timeout_ms"}),
    "timeout_ms_over_max": (envelope("execute_shell_command", {"command": "true", "timeout_ms": 60001}),
                            {"/parameters/timeout_ms"}),
    "timeout_ms_string": (envelope("execute_shell_command", {"command": "true", "timeout_ms": "5"}),
                          {"/parameters/timeout_ms"}),
    "timeout_ms_bool": (envelope("execute_shell_command", {"command": "true", "timeout_ms": True}),
                        {"/parameters/timeout_ms"}),
    "base_sha_short": (envelope("apply_file_patch", {"path": "a", "diff": "x", "base_sha": "abc"}),
                       {"/parameters/base_sha"}),
    "base_sha_not_hex": (envelope("apply_file_patch", {"path": "a", "diff": "x", "base_sha": "g" * 40}),
                         {"/parameters/base_sha"}),
    "base_sha_41": (envelope("apply_file_patch", {"path": "a", "diff": "x", "base_sha": "a" * 41}),
                    {"/parameters/base_sha"}),
    "diff_empty": (envelope("apply_file_patch", {"path": "a", "diff": "", "base_sha": SHA}), {"/parameters/diff"}),
    "command_empty": (envelope("execute_shell_command", {"command": ""}), {"/parameters/command"}),
    "command_too_long": (envelope("execute_shell_command", {"command": "x" * 65537}), {"/parameters/command"}),
    "path_too_long": (envelope(parameters={"path": "a" * 4097}), {"/parameters/path"}),
    "path_not_a_string": (envelope(parameters={"path": ["a"]}), {"/parameters/path"}),
    "parameters_not_object": (envelope(parameters=None) | {"parameters": "path=a"}, {"/parameters"}),
    "missing_call_id": ({"tool_name": "read_file", "parameters": {"path": "a"}}, {"", "/call_id"}),
    "missing_parameters": ({"tool_name": "read_file", "call_id": str(uuid.uuid4())}, {"", "/parameters"}),
    "body_is_array": ([envelope()], {""}),
    "body_is_string": ("read_file", {""}),
    "body_is_null": (None, {""}),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_schema_errors_carry_json_pointers(agent, case: str) -> None:
    body, expected = SCHEMA_CASES[case]
    key = uuid.uuid4().hex
    response = post(agent, body, key=key)
    assert_problem(response, 400, "schema_invalid")
    found = set(pointers(response))
    assert found & expected, (found, expected)
    assert all(p == "" or p.startswith("/") for p in found)
    if case == "unknown_top_level_property":
        assert "extra" in json.dumps(response.json()["errors"])
    assert_key_still_free(agent, key)


def test_shell_without_cwd_and_timeout_is_valid(agent) -> None:
    response = post(agent, envelope("execute_shell_command", {"command": "pwd"}), Prefer="wait=30")
    assert response.status_code == 200, response.text
    assert response.json()["result"]["stdout"] == "/workspace\n"


def test_shell_without_wait_is_202_with_stream_url(agent) -> None:
    body = envelope("execute_shell_command", {"command": "true", "timeout_ms": 60000, "cwd": "."})
    response = post(agent, body)
    assert response.status_code == 202, response.text
    answer = response.json()
    assert answer["status"] in ("queued", "running") and answer["call_id"] == body["call_id"]
    assert answer["tool_name"] == "execute_shell_command" and answer["task_id"]
    assert answer["stream_url"].startswith("ws://") and answer["stream_url"].endswith(f"/{answer['task_id']}/stream")


# --- refusals before acceptance are not recorded ---------------------------------------------------

# (A 401's: test_attack_tokens.py::test_refused_token_records_nothing_so_the_key_works_afterwards.)
@pytest.mark.parametrize("refusal", ["403_scope", "403_path", "400_schema", "415"])
def test_refusals_before_acceptance_leave_the_key_free(agent, make_agent, refusal: str) -> None:
    key = uuid.uuid4().hex
    if refusal == "403_scope":
        reader = make_agent(scopes=["shell:exec"], tenant=agent.tenant, run_id=agent.run_id)
        assert reader.call("read_file", {"path": "missing.txt"}, key=key).status_code == 403
    elif refusal == "403_path":
        assert post(agent, envelope(parameters={"path": "../x"}), key=key).status_code == 403
    elif refusal == "400_schema":
        assert post(agent, envelope(parameters={}), key=key).status_code == 400
    else:
        assert post(agent, envelope(), key=key, Content_Type="text/plain").status_code == 415
    assert_key_still_free(agent, key)


# --- other routes ----------------------------------------------------------------------------------

def test_tools_listing(stack) -> None:
    response = requests.get(url(stack, "/v1/tools"), timeout=30)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("application/json")
    tools = response.json()["tools"]
    assert sorted(t["name"] for t in tools) == sorted(TOOL_PARAMETERS)
    for tool in tools:
        assert set(tool) >= {"name", "description", "input_schema"}
        assert tool["description"]
    assert_tool_parameters({t["name"]: t["input_schema"] for t in tools})


def test_tools_listing_openai_format(stack) -> None:
    response = requests.get(url(stack, "/v1/tools?format=openai"), timeout=30)
    assert response.status_code == 200
    body = response.json()
    assert list(body) == ["tools"] and len(body["tools"]) == len(TOOL_PARAMETERS)
    for tool in body["tools"]:  # OpenAI's function tool: {"type": "function", "function": {name, description, parameters}}
        assert tool["type"] == "function"
        function = tool["function"]
        assert set(function) >= {"name", "description", "parameters"}
        assert isinstance(function["name"], str) and function["description"]
    assert_tool_parameters({t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]})


@pytest.mark.parametrize("fmt", ["%00%ff", "xml", "OPENAI"])
def test_tools_listing_unknown_format_is_schema_invalid(stack, fmt: str) -> None:
    response = requests.get(url(stack, f"/v1/tools?format={fmt}"), timeout=30)
    assert_problem(response, 400, "schema_invalid")
    assert "/format" in pointers(response)


def test_health_ready_metrics(stack) -> None:
    assert requests.get(url(stack, "/healthz"), timeout=30).status_code == 200
    ready = requests.get(url(stack, "/readyz"), timeout=30)
    assert ready.status_code == 200, ready.text
    metrics = requests.get(url(stack, "/metrics"), timeout=30)
    assert metrics.status_code == 200 and metrics.headers["Content-Type"].startswith("text/plain")
    assert "runwarden_http_requests_total" in metrics.text
    assert stack.secret not in metrics.text


@pytest.mark.parametrize("path", ["/nope", "/v1", "/v1/tool-calls/x/y/z", "/v2/tool-calls", "/%2e%2e/etc/passwd",
                                  "/v1/tools/../../etc/passwd"])
def test_unknown_route_is_404_problem(stack, path: str) -> None:
    response = requests.get(url(stack, path), timeout=30)
    assert_problem(response, 404, "not_found")


@pytest.mark.parametrize("method, path", [("PUT", "/v1/tool-calls"), ("GET", "/v1/tool-calls"),
                                          ("PATCH", "/v1/tool-calls/abc"), ("POST", "/v1/tools"),
                                          ("DELETE", "/healthz")])
def test_wrong_method_is_405_problem(stack, method: str, path: str) -> None:
    response = requests.request(method, url(stack, path), timeout=30)
    assert_problem(response, 405)
    assert response.headers.get("Allow")


@pytest.mark.parametrize("method", ["GET", "DELETE"])
@pytest.mark.parametrize("target", ["another_tenants", "unknown", "overlong", "no_token"])
def test_get_and_delete_of_unknown_or_foreign_task_is_404(agent, make_agent, method: str, target: str) -> None:
    """Another tenant's call is a 404 that shows nothing of it (never a 403), as an unknown id is;
    without a token, a 401."""
    agent.write("s.txt", b"rw-secret-contents\n")
    task_id = agent.call("read_file", {"path": "s.txt"}).json()["task_id"]
    token, wanted = {"another_tenants": (make_agent().token, task_id), "unknown": (agent.token, str(uuid.uuid4())),
                     "overlong": (agent.token, "x" * 500), "no_token": (None, task_id)}[target]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = requests.request(method, url(agent.stack, f"/v1/tool-calls/{wanted}"), headers=headers, timeout=30)
    if target == "no_token":
        assert_problem(response, 401, "unauthorized")
    else:
        assert_problem(response, 404, "not_found")
    assert "rw-secret-contents" not in response.text and "s.txt" not in response.text
    owner_view = agent.get(task_id).json()
    assert owner_view["status"] == "completed" and owner_view["result"]["content"] == "rw-secret-contents\n"


def test_logs_keep_no_file_contents_or_command_output(agent) -> None:
    """Celery logs what a task returns at INFO: that must not be a workspace's secrets."""
    in_file, in_output = (f"secret-{uuid.uuid4().hex}" for _ in range(2))
    agent.write("key.pem", in_file.encode())
    assert agent.call("read_file", {"path": "key.pem"}).json()["result"]["content"] == in_file
    shell = agent.shell(f"cat key.pem; echo {in_output[:7]}''{in_output[7:]}", wait=30).json()
    assert shell["result"]["stdout"] == in_file + in_output + "\n"

    def logs_with_its_line() -> str:  # written once the task has returned, maybe after the answer
        text = "".join(log.read_text(errors="replace") for log in agent.stack.logs.glob("*.log"))
        return text if f"{shell['task_id']}] succeeded" in text else ""
    logs = wait_until(logs_with_its_line, 30, "the worker's log line for the call")
    assert in_file not in logs and in_output not in logs  # the line is there, without the payload


def _task_events(pubsub: redis.client.PubSub, task_id: str, types: set[str], timeout_s: float = 30) -> dict[str, Any]:
    """Celery task events for `task_id` as Flower receives them (kombu's fanout over pub/sub): of
    every type, until those of `types` have come (a task-sent would have come before them)."""
    found: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while not types <= set(found) and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if not message or message["type"] != "pmessage":
            continue
        envelope = json.loads(message["data"])
        body = base64.b64decode(envelope["body"]) if envelope["properties"].get("body_encoding") == "base64" \
            else envelope["body"].encode()
        for event in (lambda e: e if isinstance(e, list) else [e])(json.loads(body)):
            if event.get("uuid") == task_id:
                found[event["type"]] = event
    return found


def test_task_events_show_who_and_what_never_the_diff_or_command(agent, tmp_path: Path) -> None:
    """Flower shows the args that task events carry: for runwarden a summary of the call, never a
    diff's or a command's text. Workers send task events once a monitor asks, as Flower does."""
    in_diff, in_command = (f"secret-{uuid.uuid4().hex}" for _ in range(2))
    agent.write("s.txt", b"old\n")
    diff = f"--- a/s.txt\n+++ b/s.txt\n@@ -1 +1 @@\n-old\n+{in_diff}\n"
    celery = create_celery(Settings.from_env(agent.stack.env, require_jwt=False))
    workers = sum(1 for name, _ in agent.stack.stack.children if name.startswith(("w", "node")))
    pubsub = agent.stack.redis.pubsub()
    pubsub.psubscribe("*celeryev*")
    try:
        answers = celery.control.enable_events(reply=True, timeout=30, limit=workers)  # back once all did
        assert len(answers) == workers and all("task events enabled" in str(a) for a in answers), answers
        patch = agent.call("apply_file_patch", {"path": "s.txt", "diff": diff, "base_sha": git_blob_sha(b"old\n")})
        assert patch.status_code == 200, patch.text
        events = _task_events(pubsub, patch.json()["task_id"], {"task-received", "task-succeeded"})
        shell = agent.shell(f"echo {in_command}", wait=30).json()
        events_shell = _task_events(pubsub, shell["task_id"], {"task-received", "task-succeeded"})
    finally:
        celery.control.disable_events(reply=True, timeout=30, limit=workers)
        pubsub.close()
    # The API sends no task-sent event (it was a second publish per call): Flower sees a call from
    # the worker's task-received on, whose args are the summary.
    assert "task-sent" not in events and "task-sent" not in events_shell, (set(events), set(events_shell))
    received, received_shell = events["task-received"], events_shell["task-received"]
    assert "'path': 's.txt'" in received["args"] and f"'tenant': '{agent.tenant}'" in received["args"]
    assert "'tool_name': 'execute_shell_command'" in received_shell["args"]
    assert in_diff not in json.dumps(events) and in_command not in json.dumps(events_shell)


def test_metrics_labels_do_not_echo_client_input(stack) -> None:
    marker = f"zz{uuid.uuid4().hex}"
    body = {"tool_name": marker, "call_id": str(uuid.uuid4()), "parameters": {}}
    response = requests.post(url(stack), data=json.dumps(body), timeout=10,
                             headers={"Content-Type": "application/json", "Idempotency-Key": "k"})
    assert response.status_code == 401
    assert marker not in requests.get(url(stack, "/metrics"), timeout=30).text


# --- fuzz ------------------------------------------------------------------------------------------

def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2 ** 63, -(2 ** 64), 10 ** 300, 1e308, -1e-308, 60001, 1, 3.5])
    if kind == 3:
        return "".join(rng.choice(["a", "é", "😀", "\x00", "\u202e", "/", "..", "\\", '"', "\ud7ff", " "])
                       for _ in range(rng.randrange(0, 40)))
    if kind == 4:
        return rng.choice(["read_file", "apply_file_patch", "execute_shell_command", str(uuid.uuid4()), "0" * 40])
    if kind == 5:
        return "x" * rng.randrange(0, 5000)
    if kind == 6:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    keys = ["tool_name", "call_id", "parameters", "path", "diff", "base_sha", "command", "timeout_ms", "cwd",
            "__proto__", "", "\x00", "é"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


DEEP = 10000


@pytest.mark.parametrize("raw", [
    b"[" * DEEP + b"]" * DEEP,
    b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    b'{"tool_name":"read_file","call_id":"00000000-0000-0000-0000-000000000000","parameters":' +
    b"[" * DEEP + b"]" * DEEP + b"}",
], ids=["array", "object", "in_parameters"])
def test_deeply_nested_json_is_400(agent, raw: bytes) -> None:
    assert_problem(post(agent, None, raw=raw), 400, "schema_invalid")


@pytest.mark.parametrize("tool_name", [["read_file"], {"a": 1}], ids=["list", "object"])
def test_unhashable_tool_name_is_400(agent, tool_name: Any) -> None:
    response = post(agent, envelope() | {"tool_name": tool_name})
    assert_problem(response, 400, "schema_invalid")
    assert "/tool_name" in pointers(response)


@pytest.mark.parametrize("tool_name, parameters", [
    ("read_file", {"path": "a\ud800"}),
    ("execute_shell_command", {"command": "echo \ud800"}),
], ids=["path", "command"])
def test_lone_surrogate_is_refused(agent, tool_name: str, parameters: dict) -> None:
    """Valid JSON, but not Unicode text: refused before anything runs (a hang fails on the timeout)."""
    key = uuid.uuid4().hex
    body = json.dumps(envelope(tool_name, parameters))  # ensure_ascii: the body carries the escape \\ud800
    response = requests.post(url(agent.stack), data=body, headers=agent.headers(key, Prefer="wait=10"), timeout=60)
    assert_problem(response, 400, "schema_invalid")
    assert_key_still_free(agent, key)


def _fuzz_bodies() -> list[bytes]:
    """Random JSON values (a top-level tool_name stays a string: other types have their own test above),
    random bytes, huge numbers, a lone surrogate (outside a tool parameter, see above), duplicate keys."""
    rng = random.Random(20261130)
    bodies: list[bytes] = [
        b"[" * 500 + b"]" * 500,
        b"9" * 100000,
        b"1e999999",
        b"-" + b"9" * 5000,
        b'"' + "\\ud800".encode() + b'"',
        b'{"tool_name":"execute_shell_command","call_id":"' + str(uuid.uuid4()).encode() +
        b'","parameters":{"command":"true","timeout_ms":1e400}}',
        b'{"tool_name":"read_file","call_id":"' + str(uuid.uuid4()).encode() +
        b'","parameters":{"path":"a"},"tool_name":"execute_shell_command"}',
        "\ufeff{}".encode(),
        b"\x00" * 100,
    ]
    while len(bodies) < 140:
        value = _random_json(rng)
        if isinstance(value, dict) and "tool_name" in value and not isinstance(value["tool_name"], str):
            value["tool_name"] = str(value["tool_name"])
        bodies.append(json.dumps(value).encode())
    while len(bodies) < 200:
        bodies.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
    return bodies


def test_fuzzed_bodies_never_cause_a_server_error(agent) -> None:
    failures = []
    for index, raw in enumerate(_fuzz_bodies()):
        response = post(agent, None, raw=raw)
        content_type = response.headers.get("Content-Type", "")
        ok = response.status_code < 500 and content_type in (PROBLEM_JSON, "application/json")
        if ok and content_type == PROBLEM_JSON:
            ok = isinstance(response.json().get("code"), str)
        if ok:
            try:
                assert_no_leak(response)
            except AssertionError:
                ok = False
        if not ok:
            failures.append((index, raw[:60], response.status_code, response.text[:200]))
    assert failures == [], failures


# --- issue 18 item 2: patterns mean the whole value, trailing newline included -----------------------

import socket  # noqa: E402  (appended section)

import jsonschema_rs  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from jsonschema import Draft202012Validator  # noqa: E402

from api import openapi  # noqa: E402
from shared.errors import InvalidIdempotencyKey  # noqa: E402
from shared.idempotency import parse_key  # noqa: E402
from shared.schema import TOOLS  # noqa: E402


def raw_exchange(stack, request_bytes: bytes) -> bytes:  # type: ignore[no-untyped-def]
    """Bytes http.client refuses to send (a newline inside a header value), answer read to the end."""
    parts = urlsplit(stack.base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as connection:
        connection.sendall(request_bytes)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def test_idempotency_key_with_a_newline_never_reaches_a_call(agent) -> None:
    body = json.dumps(envelope("execute_shell_command", {"command": "touch ran"})).encode()
    for key in (b"k1\n", b"k1\r", b"k1\n "):
        answer = raw_exchange(agent.stack, b"POST /v1/tool-calls HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              b"Authorization: Bearer " + agent.token.encode() + b"\r\n"
                              b"Content-Type: application/json\r\nIdempotency-Key: " + key + b"\r\n"
                              b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]  # gunicorn refuses the header itself
    assert not (agent.workspace / "ran").exists()


@pytest.mark.parametrize("key", ["k1\xa0", "k1\x85", "\xa0k1"])
def test_idempotency_key_with_other_whitespace_is_400(agent, key: str) -> None:
    """str.strip() would have taken these off (and the pattern's `$` a final newline): only the
    header's own optional whitespace, spaces and tabs, is trimmed."""
    status, text = raw_post(agent.stack, [("Authorization", f"Bearer {agent.token}"),
                                          ("Content-Type", "application/json"), ("Idempotency-Key", key)],
                            json.dumps(envelope("execute_shell_command", {"command": "touch ran"})).encode())
    assert status == 400, text
    assert json.loads(text)["code"] == "invalid_idempotency_key", text
    assert not (agent.workspace / "ran").exists()


@pytest.mark.parametrize("value", ["k1\n", "k1\r\n", "\nk1", "k1\x0b", "k1\x0c", "k1\xa0", "k1\u2028", '"k1\n"'])
def test_parse_key_refuses_a_newline_or_unicode_space(value: str) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        parse_key([value])


def test_parse_key_trims_only_spaces_and_tabs() -> None:
    assert parse_key([" \tk1 \t"]) == "k1" and parse_key([' "k1"\t']) == "k1"


def test_malformed_prefer_wait_is_ignored_not_a_server_error(agent) -> None:
    """"²" passes str.isdigit() but not int(): the call must still be answered (202), not 500."""
    status, text = raw_post(agent.stack, [("Authorization", f"Bearer {agent.token}"),
                                          ("Content-Type", "application/json"),
                                          ("Idempotency-Key", uuid.uuid4().hex), ("Prefer", "wait=\xb2")],
                            json.dumps(envelope("execute_shell_command", {"command": "true"})).encode())
    assert status == 202, text
    assert json.loads(text)["status"] == "queued"


@pytest.mark.parametrize("after_seq", ["%C2%B2", "%D9%A3", "%EF%BC%91"])
def test_after_seq_of_non_ascii_digits_is_400(agent, after_seq: str) -> None:
    from tests.test_attack_handshake import bearer, handshake, stream_path
    task_id = agent.shell("true", wait=30).json()["task_id"]
    status, headers, body = handshake(agent.stack, stream_path(task_id, f"after_seq={after_seq}"),
                                      bearer(agent.token))
    assert status == 400 and json.loads(body)["code"] == "schema_invalid", (status, body)


def _declared_patterns(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {node["pattern"]} if isinstance(node.get("pattern"), str) else set()
        return own.union(*(_declared_patterns(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_declared_patterns(value) for value in node))
    return set()


# The OpenAPI document embeds every tool's parameter schema and the header patterns.
DECLARED_PATTERNS = sorted(_declared_patterns(openapi.document()))


def test_every_pattern_is_collected() -> None:
    assert len(DECLARED_PATTERNS) >= 4, DECLARED_PATTERNS  # base_sha, command, Idempotency-Key, Prefer


@pytest.mark.parametrize("pattern", DECLARED_PATTERNS)
@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_schema_patterns_mean_what_ecma_262_means(pattern: str, data: st.DataObject) -> None:
    """jsonschema applies `pattern` with Python's re.search; jsonschema-rs with an ECMA-262-like
    engine, where `$` is the end of the string. They must agree, newlines around the value included."""
    value = data.draw(st.from_regex(pattern, fullmatch=True), label="value")
    schema = {"type": "string", "pattern": pattern}
    for probe in (value, value + "\n", "\n" + value, value + "\n" + value, value + "\r\n"):
        assert Draft202012Validator(schema).is_valid(probe) == jsonschema_rs.is_valid(schema, probe), repr(probe)


@pytest.mark.parametrize("pattern, valid", [
    (TOOLS["apply_file_patch"].parameters["properties"]["base_sha"]["pattern"], "a" * 40),
    (openapi.document()["paths"]["/v1/tool-calls"]["post"]["parameters"][0]["schema"]["pattern"], "k1"),
    (openapi.document()["paths"]["/v1/tool-calls"]["post"]["parameters"][1]["schema"]["pattern"], "wait=5"),
])
def test_patterns_refuse_a_trailing_newline(pattern: str, valid: str) -> None:
    validator = Draft202012Validator({"type": "string", "pattern": pattern})
    assert validator.is_valid(valid) and not validator.is_valid(valid + "\n")


# --- issue 18 item 3: a JSON object with a key twice is schema_invalid, wherever it is ---------------

def _raw_call(call_id: str, tool_members: str, parameters: str) -> bytes:
    return (f'{{{tool_members}, "call_id": "{call_id}", "parameters": {parameters}}}').encode()


@pytest.mark.parametrize("body, pointer", [
    (_raw_call(str(uuid.uuid4()), '"tool_name": "read_file", "tool_name": "execute_shell_command"',
               '{"command": "touch ran"}'), "/tool_name"),
    (_raw_call(str(uuid.uuid4()), '"tool_name": "execute_shell_command"',
               '{"command": "true", "command": "touch ran"}'), "/parameters/command"),
    (_raw_call(str(uuid.uuid4()), '"tool_name": "execute_shell_command"',
               '{"command": "touch ran", "timeout_ms": 1000, "timeout_ms": 2000}'), "/parameters/timeout_ms"),
    (_raw_call(str(uuid.uuid4()), '"tool_name": "execute_shell_command"',
               '{"command": "touch ran", "cwd": ".", "\\u0063wd": "."}'), "/parameters/cwd"),
    (b'{"tool_name": "execute_shell_command", "call_id": "%s", "call_id": "%s", "parameters": {"command": "touch ran"}}'
     % (str(uuid.uuid4()).encode(), str(uuid.uuid4()).encode()), "/call_id"),
])
def test_repeated_json_key_is_schema_invalid_and_runs_nothing(agent, body: bytes, pointer: str) -> None:
    key = uuid.uuid4().hex
    refused = post(agent, None, raw=body, key=key)
    problem = assert_problem(refused, 400, "schema_invalid")
    assert pointer in [error["pointer"] for error in problem["errors"]], problem
    assert not (agent.workspace / "ran").exists()
    # Nothing was claimed either: the same key then runs the call it names, once.
    ran = agent.call("execute_shell_command", {"command": "echo fine"}, key=key,
                     headers=agent.headers(key, Prefer="wait=30"))
    assert ran.status_code == 200 and ran.json()["result"]["stdout"] == "fine\n", ran.text
    assert not (agent.workspace / "ran").exists()


def test_repeated_key_deep_inside_is_found(agent) -> None:
    nested = '{"tool_name": "read_file", "call_id": "%s", "parameters": {"path": "a", "x": [1, {"y": {"z": 1, "z": 2}}]}}'
    problem = assert_problem(post(agent, None, raw=(nested % uuid.uuid4()).encode()), 400, "schema_invalid")
    assert [error["pointer"] for error in problem["errors"]] == ["/parameters/x/1/y/z"], problem


def test_repeated_key_in_a_stream_order_is_no_order(agent) -> None:
    """{"signal": "SIGTERM", "signal": "SIGKILL"} is ignored, not read as SIGKILL: the SIGINT after it
    is the signal the command gets (with the last key winning, SIGKILL would end it first, 137)."""
    from tests.streams import collect, connect
    response = agent.shell("trap 'echo got INT; exit 42' INT; echo ready; sleep 30 & wait", wait=None)
    task_id = response.json()["task_id"]
    ws = connect(agent, task_id)
    try:
        assert collect(ws, limit=1).events[0]["data"] == "ready\n"
        ws.send('{"type": "signal", "signal": "SIGTERM", "signal": "SIGKILL"}')
        ws.send(json.dumps({"type": "signal", "signal": "SIGINT"}))
        rest = collect(ws)
    finally:
        ws.close()
    assert rest.exit["exit_code"] == 42 and b"got INT" in rest.bytes_of("stdout"), rest.exit


def test_json_bodies_are_parsed_in_one_place() -> None:
    """shared.schema.loads is the API's only JSON reader of what a client sent."""
    offenders = []
    for source in sorted((Path(__file__).parent.parent / "api").rglob("*.py")):
        text = source.read_text()
        offenders += [f"{source.name}: {needle}" for needle in ("get_json", "json.loads", "request.json", "json.load(")
                      if needle in text]
    assert offenders == []
