"""HTTP-level attacks on the API server: stalled requests (slowloris on headers and body), requests
gunicorn itself refuses (oversized, malformed), forwarding headers that would shape `stream_url`,
and special files in a workspace. Raw sockets, so the bytes sent are exactly the attack's."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests import streams
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack
from workers.patching import ZERO_SHA

PROBLEM_JSON = "application/problem+json"
REQUEST_TIMEOUT_S = 3  # the dedicated stack's RUNWARDEN_REQUEST_TIMEOUT
PATIENCE_S = 60  # how long a test waits for the server: many times any bound it should keep
STALLED_BODY = (b"POST /v1/tool-calls HTTP/1.1\r\nHost: runwarden\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{")
STALLED_HEADERS = b"GET /healthz HTTP/1.1\r\nHost: runwarden\r\nX-Slow: a"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after it

    def problem(self) -> dict:  # type: ignore[type-arg]
        assert self.headers.get("content-type") == PROBLEM_JSON, self
        body = json.loads(self.body)
        assert body["status"] == self.status and isinstance(body["code"], str), body
        assert "Traceback" not in self.body.decode() and "/tmp" not in self.body.decode(), body
        return body


def address(stack: StackInfo) -> tuple[str, int]:
    host, port = stack.base_url.removeprefix("http://").split(":")
    return host, int(port)


def open_raw(stack: StackInfo, data: bytes) -> socket.socket:
    sock = socket.create_connection(address(stack), timeout=PATIENCE_S)
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server refused before reading it all; its answer is still to be read
    return sock


def read_answer(sock: socket.socket, *, until_close: bool = True) -> Answer:
    """One HTTP response; with `until_close`, then read on until the server closes (or PATIENCE_S
    passes, which fails the test: a server that neither answers nor closes is the attack's win)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)) and (chunk := sock.recv(65536)):
            body += chunk
        closed = False
        while until_close and not closed:
            closed = sock.recv(65536) == b""
    except ConnectionResetError:
        closed = True  # after its answer, the server dropped bytes it never read: a close
    assert lines[0].startswith("HTTP/1.1 "), data[:200]
    return Answer(int(lines[0].split()[1]), headers, body, closed)


def exchange(stack: StackInfo, data: bytes) -> Answer:
    with open_raw(stack, data) as sock:
        return read_answer(sock)


# --- 7. The server's own refusals are problem+json --------------------------------------------


def test_huge_header_is_431_problem_json(stack: StackInfo) -> None:
    answer = exchange(stack, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    assert answer.status == 431
    assert answer.problem()["code"] == "request_header_too_large"


def test_too_many_headers_is_431_problem_json(stack: StackInfo) -> None:
    fields = b"".join(b"X-H%d: v\r\n" % n for n in range(200))
    answer = exchange(stack, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    assert answer.status == 431
    assert answer.problem()["code"] == "request_header_too_large"


def test_long_uri_is_414_problem_json(stack: StackInfo) -> None:
    answer = exchange(stack, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.status == 414
    assert answer.problem()["code"] == "uri_too_long"


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: v\r\n\r\n",
    b"POST /v1/tool-calls HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
], ids=["request-line", "version", "header-name", "chunk-size"])
def test_malformed_request_is_400_problem_json(stack: StackInfo, request_bytes: bytes) -> None:
    answer = exchange(stack, request_bytes)
    assert answer.status == 400
    assert answer.problem()["code"] in ("bad_request", "schema_invalid")  # gunicorn's, or the app's


def log_after(path: Path, start: int, mark: bytes) -> bytes:
    """What was appended to the log `path` after offset `start`, once it holds `mark`."""
    deadline = time.monotonic() + PATIENCE_S
    while mark not in (added := path.read_bytes()[start:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return added


def test_refusals_log_neither_trace_nor_request_bytes(stack: StackInfo) -> None:
    log = stack.logs / "api.log"
    start = log.stat().st_size
    assert exchange(stack, b"GARBAGE-FOR-THE-LOG\r\n\r\n").status == 400
    added = log_after(log, start, b"Refused a request")
    assert b"Refused a request" in added and b"Traceback" not in added
    assert b"GARBAGE-FOR-THE-LOG" not in added  # a request's bytes (a token, say) are not echoed


# --- 4. stream_url and forwarding headers ----------------------------------------------------

FORWARDED = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example", "X-Forwarded-Port": "8443",
             "X-Forwarded-Prefix": "/evil", "X-Forwarded-Protocol": "ssl", "X-Forwarded-Ssl": "on"}


def shell_stream_url(agent: Agent, **headers: str) -> str:
    body = {"tool_name": "execute_shell_command", "call_id": str(uuid.uuid4()), "parameters": {"command": "true"}}
    response = agent.http.post(f"{agent.stack.base_url}/v1/tool-calls", data=json.dumps(body),
                               headers=agent.headers(**headers), timeout=PATIENCE_S)
    assert response.status_code == 202, response.text
    return response.json()["stream_url"]


def test_forwarded_headers_are_ignored_by_default(agent: Agent) -> None:
    url = shell_stream_url(agent, **FORWARDED)
    assert url.startswith(f"{agent.stack.ws_base}/v1/tool-calls/"), url


@pytest.fixture(scope="module")
def public_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("public"), concurrency=1, RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_PUBLIC_URL="https://runwarden.example/")
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


def test_public_url_is_the_base_of_every_stream_url(public_stack: StackInfo) -> None:
    agent = Agent(public_stack, f"t{uuid.uuid4().hex[:10]}", "r1", ALL_SCOPES, ["**"])
    for headers in ({}, {"Host": "evil.example"}, FORWARDED):
        url = shell_stream_url(agent, **headers)
        assert url.startswith("wss://runwarden.example/v1/tool-calls/") and url.endswith("/stream"), url


# --- 3. Stalled requests, on a stack whose request timeout is short ---------------------------


@pytest.fixture(scope="module")
def quick_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("quick"), RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT_S), RUNWARDEN_TRUSTED_PROXIES="1")
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


@pytest.fixture
def quick_agent(quick_stack: StackInfo) -> Agent:
    return Agent(quick_stack, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])


def test_trusted_proxy_headers_shape_the_stream_url(quick_agent: Agent) -> None:
    url = shell_stream_url(quick_agent, **{"X-Forwarded-Proto": "https", "X-Forwarded-Host": "api.example",
                                           "X-Forwarded-Prefix": "/runwarden"})
    assert url.startswith("wss://api.example/runwarden/v1/tool-calls/"), url


def test_stalled_body_is_answered_408_and_closed(quick_stack: StackInfo) -> None:
    answer = exchange(quick_stack, STALLED_BODY)
    assert answer.status == 408 and answer.closed
    assert answer.problem()["code"] == "request_timeout"


def test_stalled_headers_are_answered_408_and_closed(quick_stack: StackInfo) -> None:
    answer = exchange(quick_stack, STALLED_HEADERS)
    assert answer.status == 408 and answer.closed
    assert answer.problem()["code"] == "request_timeout"


def test_headers_trickled_line_by_line_are_cut_off(quick_stack: StackInfo) -> None:
    """A slowloris that keeps every gap short (a header line at a time) is bounded by the whole
    request's time, not by the gap between two reads: it is answered 408, or dropped."""
    with socket.create_connection(address(quick_stack), timeout=0.5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        answered = None
        for _ in range(90):  # each turn sends a line, then waits up to 0.5 s for the server
            try:
                sock.sendall(b"X-Drip: 1\r\n")
                answered = sock.recv(65536)
                break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                answered = b""
                break
    assert answered is not None, "the server kept reading a request trickled for 45 s"
    assert answered == b"" or answered.startswith(b"HTTP/1.1 408 "), answered[:200]


def test_stalls_beyond_every_thread_do_not_stop_the_server(quick_stack: StackInfo) -> None:
    """More stalled connections than the API has threads (256): each is cut off, and a request
    behind them is served."""
    stalled = [open_raw(quick_stack, STALLED_BODY if n % 2 else STALLED_HEADERS) for n in range(300)]
    try:
        assert requests.get(f"{quick_stack.base_url}/healthz", timeout=PATIENCE_S).status_code == 200
        answers = [read_answer(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    assert all(answer.status == 408 and answer.closed for answer in answers)


def test_idle_keep_alive_connection_outlives_the_request_timeout(quick_stack: StackInfo) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with open_raw(quick_stack, request) as kept:
        assert read_answer(kept, until_close=False).status == 200
        # A stall started after the idle connection's last request: once it is cut off, the idle
        # connection has been idle for longer than the request timeout.
        assert exchange(quick_stack, STALLED_HEADERS).status == 408
        kept.sendall(request)
        assert read_answer(kept, until_close=False).status == 200


def test_quiet_stream_and_long_wait_outlive_the_request_timeout(quick_agent: Agent) -> None:
    """A WebSocket stream of a command silent until told to go on, and a `Prefer: wait=60` POST
    for another one, both stay open across a stalled request's cut-off and end normally."""
    wait_for_go = "until [ -e go ]; do sleep 0.1; done; echo gone"
    first = quick_agent.shell(wait_for_go, wait=None)
    assert first.status_code == 202, first.text
    ws = streams.connect(quick_agent, first.json()["task_id"], timeout=PATIENCE_S)
    waited: list[requests.Response] = []
    waiter = threading.Thread(target=lambda: waited.append(quick_agent.shell(wait_for_go, wait=60)))
    try:
        waiter.start()
        assert exchange(quick_agent.stack, STALLED_BODY).status == 408
        (quick_agent.workspace / "go").touch()  # from the host: both pool processes are busy waiting
        received = streams.collect(ws)
    finally:
        ws.close()
        waiter.join(PATIENCE_S * 2)
    assert received.close_code == 1000 and received.exit["exit_code"] == 0
    assert received.bytes_of("stdout") == b"gone\n"
    assert waited and waited[0].status_code == 200, waited and waited[0].text
    assert waited[0].json()["result"]["stdout"] == "gone\n"


# --- 6. Special files in the workspace --------------------------------------------------------


def assert_path_forbidden(response: requests.Response) -> None:
    assert response.status_code == 403, response.text
    assert response.headers["Content-Type"] == PROBLEM_JSON
    assert response.json()["code"] == "path_forbidden"


def special_files(agent: Agent) -> list[str]:
    """A Unix socket made inside the sandbox, and (where this host lets the test make them) a
    character device with a driver and one without."""
    made = agent.shell("python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"", wait=60)
    assert made.json()["result"]["exit_code"] == 0, made.text
    names = ["sock"]
    for name, device in (("null-dev", os.makedev(1, 3)), ("no-driver-dev", os.makedev(511, 0))):
        try:
            os.mknod(agent.workspace / name, stat.S_IFCHR | 0o600, device)
        except PermissionError:
            continue  # no CAP_MKNOD here: the socket alone takes the same path (open fails)
        names.append(name)
    return names


def test_special_files_are_refused_as_path_forbidden(agent: Agent) -> None:
    worker_log = agent.stack.logs / "worker0.log"
    start = worker_log.stat().st_size
    for name in special_files(agent):
        key = uuid.uuid4().hex
        read_call = str(uuid.uuid4())
        for _ in range(2):  # the retry with the same key is answered the same way
            assert_path_forbidden(agent.call("read_file", {"path": name}, key=key, call_id=read_call))
        patch = {"path": name, "diff": f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1 @@\n+x\n", "base_sha": ZERO_SHA}
        key, patch_call = uuid.uuid4().hex, str(uuid.uuid4())
        for _ in range(2):
            assert_path_forbidden(agent.call("apply_file_patch", patch, key=key, call_id=patch_call))
    assert stat.S_ISSOCK((agent.workspace / "sock").lstat().st_mode)  # nothing replaced it
    added = worker_log.read_bytes()[start:]  # written before each call's answer
    assert b"Traceback" not in added and b"No such device or address" not in added
