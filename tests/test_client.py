"""The Python client (`runwarden_client`) and `runwarden call`, against the real stack.

Faults come from a TCP proxy (tests/proxy.py) between the client and the API: it drops answers,
cuts streams, answers 503/429 itself or alters bytes, each exactly once, so every retry path runs
deterministically.
"""
from __future__ import annotations

import hashlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from runwarden_client import (ZERO_SHA, BaseShaMismatch, Client, ConnectionFailed, Exit, FileNotFound,
                              IntegrityError, Output, PathForbidden, RateLimited, RunwardenError, Unavailable,
                              blob_sha)
from runwarden_client.errors import QuotaExceeded
from runwarden_client.retry import RetryPolicy, retry_after
from tests.proxy import Proxy, problem_answer

RUNWARDEN = str(Path(sys.executable).with_name("runwarden"))

# Written by `printf` from octal escapes of these very bytes, so the expectation is independent of
# the client: CRLF, a tab, quotes and backslashes, 2- and 4-byte UTF-8, and bytes that are not UTF-8.
AWKWARD_OUT = b'crlf\r\ntab\there "q" \\back\\ \xc3\xa9 \xf0\x9f\x98\x80 \xff\xfe bad \xc3( end\r\n'
AWKWARD_ERR = b"err\t\xe4\xbd\xa0\r\n\xfe\n"
# ~1 MiB, more than the HTTP copy holds (1 MiB), so it can only come whole from the stream.
BIG_LINE, BIG_SIZE = b"ab\tc\r\xc3\xa9 \xff", (1 << 20) + 4099
BIG = (BIG_LINE + b"\n") * (BIG_SIZE // len(BIG_LINE + b"\n") + 1)


def octal(data: bytes) -> str:
    return "".join(f"\\{byte:03o}" for byte in data)


AWKWARD_COMMAND = f"printf '{octal(AWKWARD_OUT)}'; printf '{octal(AWKWARD_ERR)}' >&2"
BIG_COMMAND = f"yes \"$(printf '{octal(BIG_LINE)}')\" | head -c {BIG_SIZE}"


@pytest.fixture
def client(agent) -> Client:
    return Client(agent.stack.base_url, agent.token)


@pytest.fixture
def proxy(stack):  # type: ignore[no-untyped-def]
    proxy = Proxy(stack.base_url)
    yield proxy
    proxy.close()


def creation_diff(name: str, text: str) -> str:
    lines = text.splitlines(keepends=True)
    return f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}" for line in lines)


def cli(agent, *args: str, url: str | None = None, **kwargs) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "RUNWARDEN_URL": url or agent.stack.base_url, "RUNWARDEN_TOKEN": agent.token}
    return subprocess.run([RUNWARDEN, "call", *args], env=env, capture_output=True, timeout=120, **kwargs)


def wait_for(condition, what: str, timeout_s: float = 60):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- importable on its own ---------------------------------------------------------------------

def test_client_imports_nothing_of_the_server(tmp_path: Path) -> None:
    server = ["celery", "flask", "api", "shared", "workers", "redis", "kombu", "jsonschema", "jwt"]
    probe = (f"import sys, runwarden_client; print(sorted(m for m in sys.modules if m.split('.')[0] in {server!r}))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- files -------------------------------------------------------------------------------------

def test_create_read_patch_and_a_stale_base_sha(client: Client, agent) -> None:
    text = "one\r\ntwo\tcols \n\u00e9t\u00e9 \U0001F600\n"
    created = client.apply_patch("src/a.txt", creation_diff("src/a.txt", text), base_sha=ZERO_SHA)
    assert created.created and not created.deleted and created.new_sha == blob_sha(text.encode())
    read = client.read_file("src/a.txt")
    assert read.content == text.encode() == (agent.workspace / "src/a.txt").read_bytes()
    assert read.sha == created.new_sha and read.encoding == "utf-8" and read.size == len(text.encode())

    diff = "--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1,3 +1,3 @@\n one\r\n-two\tcols \n+2\tcols \n \u00e9t\u00e9 \U0001F600\n"
    patched = client.apply_patch("src/a.txt", diff, old_content=read.content)  # base_sha computed here
    new = text.replace("two", "2").encode()
    assert patched.base_sha == read.sha and patched.new_sha == blob_sha(new)
    assert (agent.workspace / "src/a.txt").read_bytes() == new

    with pytest.raises(BaseShaMismatch) as stale:
        client.apply_patch("src/a.txt", diff, old_content=read.content)  # made against the old bytes
    assert stale.value.status == 412 and stale.value.current_sha == blob_sha(new)
    assert (agent.workspace / "src/a.txt").read_bytes() == new


def test_a_patch_set_all_or_nothing_dry_run_and_replay(client: Client, agent) -> None:
    a, b = "a\r\n", "b\tb \u00e9\n"
    created = client.apply_patches([{"path": "set/a.txt", "diff": creation_diff("set/a.txt", a), "base_sha": ZERO_SHA},
                                    {"path": "set/b.txt", "diff": creation_diff("set/b.txt", b), "base_sha": ZERO_SHA}],
                                   idempotency_key="set-1")
    assert not created.dry_run and not created.replayed
    assert [(f.path, f.created, f.new_sha) for f in created.files] == [
        ("set/a.txt", True, blob_sha(a.encode())), ("set/b.txt", True, blob_sha(b.encode()))]
    assert (agent.workspace / "set/b.txt").read_bytes() == b.encode()

    update = {"path": "set/a.txt", "diff": "--- a/set/a.txt\n+++ b/set/a.txt\n@@ -1 +1 @@\n-a\r\n+A\r\n",
              "old_content": a.encode()}
    dry = client.apply_patches([update], dry_run=True)
    assert dry.dry_run and dry.files[0].new_sha == blob_sha(b"A\r\n")
    assert (agent.workspace / "set/a.txt").read_bytes() == a.encode()  # nothing written

    stale = {"path": "set/b.txt", "diff": "--- a/set/b.txt\n+++ b/set/b.txt\n@@ -1 +1 @@\n-old\n+new\n",
             "base_sha": blob_sha(b"old\n")}
    with pytest.raises(BaseShaMismatch) as refused:
        client.apply_patches([update, stale])
    assert refused.value.failed_index == 1 and refused.value.current_sha == blob_sha(b.encode())
    assert (agent.workspace / "set/a.txt").read_bytes() == a.encode()  # entry 0 was not applied either

    again = client.apply_patches([{"path": "set/a.txt", "diff": creation_diff("set/a.txt", a), "base_sha": ZERO_SHA},
                                  {"path": "set/b.txt", "diff": creation_diff("set/b.txt", b), "base_sha": ZERO_SHA}],
                                 idempotency_key="set-1", call_id=created.call_id)  # the same request again
    assert again.replayed and again.files == created.files and again.task_id == created.task_id
    with pytest.raises(TypeError):
        client.apply_patches([{"path": "x", "diff": "", "base_sha": ZERO_SHA, "old_content": b""}])


def test_bytes_that_are_not_utf8_and_refusals(client: Client, agent) -> None:
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "blob.bin").write_bytes(b"\xff\xfe\x00\x01 not text \xc3(")
    read = client.read_file("blob.bin")
    assert read.encoding == "base64" and read.content == b"\xff\xfe\x00\x01 not text \xc3("
    assert read.sha == blob_sha(read.content)
    with pytest.raises(PathForbidden) as forbidden:
        client.read_file("../outside")
    assert forbidden.value.status == 403 and forbidden.value.code == "path_forbidden"
    with pytest.raises(FileNotFound):
        client.read_file("missing.txt")
    with pytest.raises(TypeError):
        client.apply_patch("x", "", base_sha=ZERO_SHA, old_content=b"")


# -- shell: byte for byte ----------------------------------------------------------------------

def test_run_is_byte_exact_small_and_past_the_http_copy(client: Client) -> None:
    small = client.run(AWKWARD_COMMAND + "; exit 3")
    assert (small.stdout, small.stderr, small.exit_code) == (AWKWARD_OUT, AWKWARD_ERR, 3)
    assert small.status == "completed" and small.signal is None and not small.truncated
    assert small.stdout_sha256 == hashlib.sha256(AWKWARD_OUT).hexdigest()

    big = client.run(BIG_COMMAND)
    assert big.exit_code == 0 and big.stdout_bytes == BIG_SIZE
    assert big.stdout == BIG[:BIG_SIZE]  # whole: the HTTP copy alone would stop at 1 MiB


def test_stream_events_are_byte_exact(client: Client) -> None:
    stream = client.stream(AWKWARD_COMMAND + "; kill -TERM $$")
    events = list(stream)
    outputs = [e for e in events if isinstance(e, Output)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert b"".join(e.data for e in outputs if e.stream == "stdout") == AWKWARD_OUT == stream.stdout
    assert b"".join(e.data for e in outputs if e.stream == "stderr") == AWKWARD_ERR == stream.stderr
    exit = events[-1]
    assert isinstance(exit, Exit) and exit is stream.exit
    assert (exit.exit_code, exit.signal) == (143, "SIGTERM")
    late = list(client.stream(task_id=stream.task_id, after_seq=1))  # a late reader, from seq 2
    assert late == events[1:]


def test_signal_and_cancel(client: Client) -> None:
    trapped = client.stream("trap 'echo got TERM; exit 9' TERM; echo ready; while :; do sleep 0.05; done")
    assert b"ready" in next(iter(trapped)).data  # type: ignore[union-attr]
    client.signal(trapped.task_id, "SIGTERM")  # on a connection of its own
    exit = [e for e in trapped if isinstance(e, Exit)][0]
    assert exit.exit_code == 9 and trapped.stdout == b"ready\ngot TERM\n"

    sleeper = client.stream("echo ready; sleep 60")
    assert b"ready" in next(iter(sleeper)).data  # type: ignore[union-attr]
    client.cancel(sleeper.task_id)
    assert [e for e in sleeper if isinstance(e, Exit)][0].status == "cancelled"
    assert client.get(sleeper.task_id).status == "cancelled"


# -- retries: one key per logical call, so nothing runs twice -----------------------------------

def _posts(proxy: Proxy) -> list[bytes]:
    return [head for head in proxy.heads if head.startswith(b"POST /v1/tool-calls ")]


def _key(head: bytes) -> bytes:
    return [line for line in head.split(b"\r\n") if line.lower().startswith(b"idempotency-key:")][0]


def test_patch_whose_answer_was_lost_is_applied_once(client: Client, proxy: Proxy, agent) -> None:
    client.apply_patch("n.txt", creation_diff("n.txt", "1\n"), base_sha=ZERO_SHA)
    flaky = Client(proxy.url, agent.token)
    proxy.drop_answers = 1
    result = flaky.apply_patch("n.txt", "--- a/n.txt\n+++ b/n.txt\n@@ -1 +1,2 @@\n 1\n+2\n", old_content=b"1\n")
    assert [what for _, what in proxy.log if what.startswith("dropped")] == ["dropped HTTP/1.1 200 OK"]
    posts = _posts(proxy)
    assert len(posts) == 2 and _key(posts[0]) == _key(posts[1])  # the same key, so a replay
    assert result.replayed and result.new_sha == blob_sha(b"1\n2\n")
    assert (agent.workspace / "n.txt").read_bytes() == b"1\n2\n"


def test_command_whose_answer_was_lost_runs_once(proxy: Proxy, agent) -> None:
    flaky = Client(proxy.url, agent.token)
    proxy.drop_answers = 1
    result = flaky.run("echo ran >> ran.txt; printf 'out\\r\\n'")
    assert result.stdout == b"out\r\n" and result.exit_code == 0
    assert [what for _, what in proxy.log if what.startswith("dropped")]
    assert (agent.workspace / "ran.txt").read_bytes() == b"ran\n"  # once
    posts = _posts(proxy)
    assert len(posts) == 2 and _key(posts[0]) == _key(posts[1])


def test_call_still_running_is_followed_not_run_again(proxy: Proxy, agent) -> None:
    key, call_id = f"k-{uuid.uuid4()}", str(uuid.uuid4())
    command = "until [ -e go ]; do sleep 0.05; done; echo ran >> ran.txt; echo finished"
    first = agent.call("execute_shell_command", {"command": command}, key=key, call_id=call_id)
    assert first.status_code == 202, first.text
    results: queue.Queue[object] = queue.Queue()
    retry = Client(proxy.url, agent.token)  # as a platform retrying after its own restart
    threading.Thread(target=lambda: results.put(retry.run(command, idempotency_key=key, call_id=call_id)),
                     daemon=True).start()
    wait_for(lambda: any("409" in what for _, what in proxy.log), "the retry to meet the running call")
    (agent.workspace / "go").touch()
    result = results.get(timeout=90)
    assert result.stdout == b"finished\n" and result.task_id == first.json()["task_id"]  # type: ignore[attr-defined]
    assert (agent.workspace / "ran.txt").read_bytes() == b"ran\n"


def test_stream_cut_midway_resumes_after_the_last_seq(proxy: Proxy, agent) -> None:
    flaky = Client(proxy.url, agent.token)
    proxy.cut_streams = 1
    stream = flaky.stream("printf 'one\\n'; sleep 0.2; printf 'two\\n' >&2; printf 'three\\n'; exit 4")
    events = list(stream)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no duplicate
    assert stream.stdout == b"one\nthree\n" and stream.stderr == b"two\n"
    assert isinstance(events[-1], Exit) and events[-1].exit_code == 4
    handshakes = [head.split(b"\r\n")[0] for head in proxy.heads if head.startswith(b"GET ")]
    assert len(handshakes) == 2 and b"after_seq=1 " in handshakes[1], handshakes


def test_stream_whose_bytes_were_altered_is_refused(proxy: Proxy, agent) -> None:
    proxy.tamper = (b"marker", b"market")
    with pytest.raises(IntegrityError):
        list(Client(proxy.url, agent.token).stream("printf 'marker'"))
    assert ("tampered" in [what for _, what in proxy.log])


@pytest.mark.parametrize("status,code,wait_s", [(503, "unavailable", 1), (429, "rate_limited", 2)])
def test_retry_after_is_honoured(proxy: Proxy, agent, client: Client, status: int, code: str, wait_s: int) -> None:
    client.apply_patch("r.txt", creation_diff("r.txt", "r\n"), base_sha=ZERO_SHA)
    proxy.canned.append(problem_answer(status, code, wait_s))
    assert Client(proxy.url, agent.token).read_file("r.txt").content == b"r\n"
    canned = [at for at, what in proxy.log if what.startswith("canned")]
    requests = [at for at, what in proxy.log if what.startswith("request")]
    assert len(canned) == 1 and len(requests) == 2 and _key(proxy.heads[0]) == _key(proxy.heads[1])
    assert requests[1] - canned[0] >= wait_s  # it waited as long as it was told, at least


def test_retry_after_beyond_the_deadline_gives_up_at_once(proxy: Proxy, agent) -> None:
    proxy.canned.append(problem_answer(429, "quota_exceeded", 3600))
    with pytest.raises(QuotaExceeded) as refused:
        Client(proxy.url, agent.token, retry_deadline=30).read_file("r.txt")
    assert isinstance(refused.value, RateLimited) and refused.value.status == 429
    assert len(proxy.heads) == 1


def test_no_server_is_a_connection_failure() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # bound then closed: nothing listens there
    with pytest.raises(ConnectionFailed):
        Client(f"http://127.0.0.1:{port}", "t", retries=2).read_file("x")


# -- the CLI -----------------------------------------------------------------------------------

def test_cli_sh_is_byte_exact_on_stdout_and_stderr(agent) -> None:
    done = cli(agent, "sh", "--", AWKWARD_COMMAND)
    assert (done.returncode, done.stdout, done.stderr) == (0, AWKWARD_OUT, AWKWARD_ERR)
    big = cli(agent, "sh", "--", BIG_COMMAND)
    assert big.returncode == 0 and big.stdout == BIG[:BIG_SIZE]


@pytest.mark.parametrize("command,code", [("exit 3", 3), ("kill -TERM $$", 143), ("true", 0)])
def test_cli_sh_exits_with_the_commands_status(agent, command: str, code: int) -> None:
    assert cli(agent, "sh", "--", command).returncode == code


def test_cli_sh_joins_words_as_ssh_does(agent) -> None:
    done = cli(agent, "sh", "--", "printf", "'%s|'", "a", "b")
    assert done.stdout == b"a|b|" and done.returncode == 0


def test_cli_forwards_ctrl_c_to_the_command(agent) -> None:
    env = {**os.environ, "RUNWARDEN_URL": agent.stack.base_url, "RUNWARDEN_TOKEN": agent.token}
    process = subprocess.Popen([RUNWARDEN, "call", "sh", "--", "trap 'echo got INT; exit 7' INT; echo started; sleep 60"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines: queue.Queue[bytes] = queue.Queue()
        assert process.stdout is not None
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()  # type: ignore[union-attr]
        assert lines.get(timeout=60) == b"started\n"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 7
        assert lines.get(timeout=10) == b"got INT\n"
    finally:
        process.kill()
        process.wait()


def test_cli_read_and_patch(agent) -> None:
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "b.bin").write_bytes(b"\xff\x00x\r\n")
    read = cli(agent, "read", "b.bin")
    assert (read.returncode, read.stdout) == (0, b"\xff\x00x\r\n")
    assert cli(agent, "read", "--sha", "b.bin").stdout.decode().strip() == blob_sha(b"\xff\x00x\r\n")

    diff = agent.workspace.parent / f"{agent.run_id}.diff"
    diff.write_text(creation_diff("c.txt", "c\n"))
    created = cli(agent, "patch", "c.txt", "--diff", str(diff), "--create")
    assert created.returncode == 0 and blob_sha(b"c\n") in created.stdout.decode()
    again = cli(agent, "patch", "c.txt", "--diff", str(diff), "--base-sha", ZERO_SHA)
    assert again.returncode == 1 and again.stderr.decode().startswith("runwarden: base_sha_mismatch: ")
    assert blob_sha(b"c\n") in again.stderr.decode()


def test_cli_refusals_and_usage_errors(agent) -> None:
    forbidden = cli(agent, "read", "../etc/passwd")
    assert forbidden.returncode == 1 and forbidden.stderr.startswith(b"runwarden: path_forbidden: ")
    assert cli(agent, "patch", "c.txt", "--diff", "/dev/null").returncode == 2  # neither --base-sha nor --create
    env = {k: v for k, v in os.environ.items() if k != "RUNWARDEN_TOKEN"}
    assert subprocess.run([RUNWARDEN, "call", "read", "x"], env=env, capture_output=True, timeout=60).returncode == 2


# -- pure parts --------------------------------------------------------------------------------

def test_blob_sha_is_gits(tmp_path: Path) -> None:
    data = b"\xff\r\nblob\0 bytes\n"
    (tmp_path / "f").write_bytes(data)
    git = subprocess.run(["git", "hash-object", str(tmp_path / "f")], capture_output=True, text=True, check=True)
    assert blob_sha(data) == git.stdout.strip() and blob_sha(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


def test_retry_after_and_backoff() -> None:
    assert retry_after("3") == 3.0 and retry_after(None) is None and retry_after("soon") is None
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: now
    policy = RetryPolicy(base_s=1, cap_s=8)
    for failures, low, high in [(1, 0.5, 1), (2, 1, 2), (4, 4, 8), (9, 4, 8)]:
        assert all(low <= policy.backoff(failures) <= high for _ in range(50))


def test_problem_codes_map_to_classes() -> None:
    stale = RunwardenError.from_problem(412, {"code": "base_sha_mismatch", "detail": "d", "current_sha": "ab"})
    assert isinstance(stale, BaseShaMismatch) and stale.current_sha == "ab" and str(stale) == "base_sha_mismatch: d"
    assert isinstance(RunwardenError.from_problem(503, {"code": "workspace_unavailable"}), Unavailable)
    unknown = RunwardenError.from_problem(418, {"code": "teapot", "detail": "short and stout"})
    assert type(unknown) is RunwardenError and (unknown.status, unknown.code) == (418, "teapot")
