"""Fault injection on real processes: worker children and mains killed, Redis restarted.

Every test starts its own small stack (redis-server, `celery … worker` mains with their prefork
children, gunicorn) and breaks it on purpose. Processes are found through /proc: a worker main is
the Popen in `StackInfo.stack.children`, its pool children are the processes whose parent it is.
Figures (recovery times, counts) are printed; run with `-s` to see them.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import requests

from runwarden import devstack
from shared import keys
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack
from tests.streams import collect, connect, raw_upgrade
from workers.patching import git_blob_sha

TERMINAL = {"completed", "failed", "cancelled", "lost"}


# --- processes, read from /proc ---------------------------------------------------------------

def proc_table() -> dict[int, tuple[int, list[bytes], bytes]]:
    """pid -> (ppid, argv, state) for every live process on the host."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), argv, fields[0])
    return table


def alive(pid: int) -> bool:
    entry = proc_table().get(pid)
    return entry is not None and entry[2] not in (b"Z", b"X")


def pool_children(main_pid: int) -> list[int]:
    """The ForkPoolWorker children of a celery main process (forked: same argv as the main)."""
    return sorted(pid for pid, (ppid, argv, state) in proc_table().items()
                  if ppid == main_pid and state not in (b"Z", b"X") and b"celery" in b" ".join(argv))


def worker_mains(info: StackInfo) -> dict[str, subprocess.Popen[bytes]]:
    return {name: popen for name, popen in info.stack.children if name.startswith("w")}


def processes_with_argv(argv: list[bytes]) -> list[int]:
    return [pid for pid, (_, found, state) in proc_table().items() if found == argv and state not in (b"Z", b"X")]


def task_field(info: StackInfo, task_id: str, field: str) -> str | None:
    value = info.redis.hget(keys.task(task_id), field)
    return value.decode() if value is not None else None


def worker_main_pid(info: StackInfo, task_id: str) -> int:
    """The `worker` field of the task record is "host:pid" of the worker main that runs it."""
    return int(task_field(info, task_id, "worker").rsplit(":", 1)[1])  # type: ignore[union-attr]


def wait_until(check, timeout_s: float, what: str, interval: float = 0.02):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def terminal(agent: Agent, task_id: str, timeout_s: float) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        response = agent.get(task_id)
        assert response.status_code == 200, response.text
        body = response.json()
        return body if body["status"] in TERMINAL else None
    return wait_until(done, timeout_s, f"{task_id} to reach a terminal status", 0.1)


def new_agent(info: StackInfo, prefix: str = "t") -> Agent:
    return Agent(info, f"{prefix}{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])


def post_shell(agent: Agent, command: str, *, key: str | None = None, call_id: str | None = None,
               **parameters: Any) -> requests.Response:
    return agent.call("execute_shell_command", {"command": command, **parameters}, key=key, call_id=call_id)


def own_stack(tmp: Path, **kwargs: Any):  # type: ignore[no-untyped-def]
    workspaces = reachable_workspaces()
    info = start_stack(tmp, RUNWARDEN_WORKSPACES=str(workspaces), **kwargs)
    return info, workspaces


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Two worker mains with one pool child each: a killed child is replaced, the other worker stays."""
    tmp = tmp_path_factory.mktemp("pair")
    (tmp / "holds").mkdir()
    info, workspaces = own_stack(tmp, workers=2, concurrency=1, RUNWARDEN_TEST_HOLD_DIR=str(tmp / "holds"))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


# --- 1. worker child SIGKILLed in the middle of a patch -----------------------------------------

BIG_LINES = 2_000_000  # ~26 MB: big enough that reading, splitting and writing take a while


def _big_file() -> bytes:
    return b"".join(b"line %07d\n" % i for i in range(BIG_LINES))


def _one_line_diff(line_no: int, old: bytes, new: bytes) -> str:
    return (f"--- a/big.txt\n+++ b/big.txt\n@@ -{line_no},1 +{line_no},1 @@\n"
            f"-{old.decode()}+{new.decode()}")


def nameless_file_size(pair: StackInfo, pid: int) -> int:
    """Bytes in the nameless file (O_TMPFILE, '<root>/#<inode> (deleted)' in /proc) a pool child
    writes a prepared patch to before giving it a name; 0 if it holds none."""
    root = os.path.realpath(pair.workspaces)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(root + "/#") and target.endswith(" (deleted)"):
                return os.stat(f"/proc/{pid}/fd/{fd}").st_size
    return 0


def warm_up_patch(agent: Agent) -> None:
    """One small patch, which loads the start script into Redis as any earlier patch would: on a
    fresh Redis (NOSCRIPT) a prepared patch's start runs only after its new file is written."""
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "warm.txt").write_bytes(b"a\n")
    diff = "--- a/warm.txt\n+++ b/warm.txt\n@@ -1 +1 @@\n-a\n+b\n"
    assert agent.call("apply_file_patch", {"path": "warm.txt", "base_sha": git_blob_sha(b"a\n"),
                                           "diff": diff}).status_code == 200


class Hold:
    """A worker held at `moment` of one call (workers/holds.py, armed through the pair's
    RUNWARDEN_TEST_HOLD_DIR): no race with how fast the worker gets there or past it."""

    def __init__(self, info: StackInfo, task_id: str, moment: str) -> None:
        self.armed = Path(info.env["RUNWARDEN_TEST_HOLD_DIR"]) / f"{task_id}.{moment}"
        self.armed.touch()

    def wait(self, timeout_s: float = 60) -> int:
        """The pid of the pool child, once it is held there."""
        held = self.armed.with_name(f"{self.armed.name}.held")
        return int(wait_until(lambda: held.exists() and held.read_text(), timeout_s, f"a worker at {held.name}"))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("moment", ["during_write", "after_replace"])
def test_patch_worker_sigkilled_applies_once_and_atomically(pair: StackInfo, moment: str) -> None:
    """SIGKILL the pool child while it holds half of the new file written, or right after the
    rename but before the outcome is recorded (the worker is held at each moment, so the window is
    certain). The file is always the old or the new version, the call ends, the redelivered
    message does not apply the patch a second time, and a retry replays."""
    agent = new_agent(pair)
    agent.workspace.mkdir(parents=True, exist_ok=True)
    old = _big_file()
    (agent.workspace / "big.txt").write_bytes(old)
    n = BIG_LINES // 2
    new = old.replace(b"line %07d\n" % (n - 1), b"changed!\n", 1)
    old_sha, new_sha = git_blob_sha(old), git_blob_sha(new)
    params = {"path": "big.txt", "base_sha": old_sha,
              "diff": _one_line_diff(n, b"line %07d\n" % (n - 1), b"changed!\n")}
    key, call_id = f"patch-{uuid.uuid4()}", str(uuid.uuid4())
    task_id = keys.task_id_for(agent.tenant, key)

    warm_up_patch(agent)
    hold = Hold(pair, task_id, "mid_write" if moment == "during_write" else "before_finish")
    first: dict[str, requests.Response] = {}
    poster = threading.Thread(target=lambda: first.update(r=agent.call("apply_file_patch", params, key=key,
                                                                       call_id=call_id)))
    poster.start()
    victim = hold.wait()
    # The start (the lock and the intent) was sent before the new bytes were written.
    wait_until(lambda: task_field(pair, task_id, "status") == "running", 30, "the start")
    assert pair.redis.exists(keys.patch_intent(task_id))
    nameless = nameless_file_size(pair, victim)
    if moment == "during_write":
        halves = [nameless] + [p.stat().st_size for p in agent.workspace.glob(".big.txt.rw-*")]
        assert len(new) // 2 in halves, halves  # half the new bytes are written, the rest not yet
        assert git_blob_sha((agent.workspace / "big.txt").read_bytes()) == old_sha
    else:
        assert git_blob_sha((agent.workspace / "big.txt").read_bytes()) == new_sha  # renamed in
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not alive(victim), 30, "the child to die")
    print(f"\n[faults] patch {moment}: SIGKILL pid {victim}"
          + (f"; nameless file had {nameless} bytes of {len(new)}" if moment == "during_write" else ""))
    assert task_field(pair, task_id, "status") == "running"  # the outcome was never recorded
    sha_after_kill = git_blob_sha((agent.workspace / "big.txt").read_bytes())
    assert sha_after_kill == (old_sha if moment == "during_write" else new_sha)  # never half a file

    # The message is delivered again (acks_late + reject_on_worker_lost); the call must end.
    final = terminal(agent, task_id, 60)
    recovered_s = time.monotonic() - killed_at
    poster.join(60)
    print(f"[faults] patch {moment}: terminal '{final['status']}' {recovered_s:.1f} s after the kill, "
          f"attempts={task_field(pair, task_id, 'attempts')}, POST answered {first['r'].status_code}")
    assert final["status"] == "completed" and final["result"]["new_sha"] == new_sha, final
    assert git_blob_sha((agent.workspace / "big.txt").read_bytes()) == new_sha
    assert task_field(pair, task_id, "attempts") == "2"  # the redelivery, which found the lock (and intent) its own
    assert [p.name for p in agent.workspace.iterdir() if p.name.startswith(".big.txt")] == []

    # Retries with the same key and the same request: the patch never applies twice.
    for _ in range(2):
        retry = agent.call("apply_file_patch", params, key=key, call_id=call_id)
        deadline = time.monotonic() + 75
        # 409: the first is still running; 503: not the call's outcome, retry (what a careful client does).
        while retry.status_code in (409, 503) and time.monotonic() < deadline:
            time.sleep(float(retry.headers.get("Retry-After", "2")))
            retry = agent.call("apply_file_patch", params, key=key, call_id=call_id)
        assert retry.status_code == 200, retry.text
        assert retry.json()["result"]["new_sha"] == new_sha
        assert git_blob_sha((agent.workspace / "big.txt").read_bytes()) == new_sha
        print(f"[faults] patch {moment}: retry answered 200 {time.monotonic() - killed_at:.1f} s after the kill "
              f"(replayed: {retry.headers.get('Idempotent-Replayed') == 'true'}); file at new_sha, applied once")
    assert retry.headers.get("Idempotent-Replayed") == "true"
    assert retry.json()["status"] == "completed"


@pytest.mark.timeout(90)
def test_redelivered_patch_completes_promptly(pair: StackInfo) -> None:
    """After its worker child is SIGKILLed mid-patch (file lock held, half the new file written),
    the redelivered message finishes the call (completed, no 5xx) at once: not after the broker's
    visibility timeout (120 s here)."""
    agent = new_agent(pair)
    agent.workspace.mkdir(parents=True, exist_ok=True)
    old = _big_file()
    (agent.workspace / "big.txt").write_bytes(old)
    params = {"path": "big.txt", "base_sha": git_blob_sha(old),
              "diff": _one_line_diff(1, b"line 0000000\n", b"first!\n")}
    key, call_id = f"patch-{uuid.uuid4()}", str(uuid.uuid4())
    task_id = keys.task_id_for(agent.tenant, key)
    poster = threading.Thread(target=lambda: agent.call("apply_file_patch", params, key=key, call_id=call_id),
                              daemon=True)
    warm_up_patch(agent)
    hold = Hold(pair, task_id, "mid_write")
    poster.start()
    victim = hold.wait()
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    final = terminal(agent, task_id, 60)
    print(f"\n[faults] redelivered patch: '{final['status']}' ({final['result'].get('code')}) "
          f"{time.monotonic() - killed_at:.1f} s after the kill")
    assert final["status"] == "completed", final
    assert task_field(pair, task_id, "attempts") == "2"


# --- 2. worker child SIGKILLed during a shell call ------------------------------------------------

@pytest.mark.timeout(90)
def test_shell_worker_sigkilled_call_is_lost_once_never_rerun(pair: StackInfo) -> None:
    agent = new_agent(pair)
    marker = f"30.{secrets.randbelow(10**6):06d}"  # a sleep nobody else on the host runs
    command = f"echo run >> runs.txt; echo started; sleep {marker}"
    key, call_id = f"shell-{uuid.uuid4()}", str(uuid.uuid4())
    accepted = post_shell(agent, command, key=key, call_id=call_id)
    assert accepted.status_code == 202, accepted.text
    task_id = accepted.json()["task_id"]
    ws = connect(agent, task_id)
    head = collect(ws, limit=1)
    assert head.events[0]["data"] == "started\n"
    # "started" is printed before bash has forked and exec'd the sleep: wait for it to show.
    sleepers = wait_until(lambda: processes_with_argv([b"sleep", marker.encode()]), 30, "the sandboxed sleep")
    assert len(sleepers) == 1  # the sandboxed command is there, seen from the host
    victim_main = worker_main_pid(pair, task_id)
    [victim] = pool_children(victim_main)
    other_mains = {p.pid for p in worker_mains(pair).values()} - {victim_main}
    assert len(other_mains) == 1

    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    # bwrap runs with --die-with-parent and is the PID namespace's init: everything inside goes.
    wait_until(lambda: not processes_with_argv([b"sleep", marker.encode()]), 30, "the sandboxed sleep to end")
    gone_s = time.monotonic() - killed_at
    rest = collect(ws)  # the stream must end by itself: exactly one exit event, saying lost
    ws.close()
    stream_end_s = time.monotonic() - killed_at
    events = head.events + rest.events
    exits = [e for e in events if e["type"] == "exit"]
    assert len(exits) == 1 and events[-1] is exits[0], events
    assert exits[0]["status"] == "lost" and exits[0]["termination"] == "lost"
    assert exits[0]["exit_code"] is None and exits[0]["peak_memory_bytes"] is None  # nothing known, nothing made up
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert rest.close_code == 1000

    final = terminal(agent, task_id, 60)
    lost_s = time.monotonic() - killed_at
    assert final["status"] == "lost" and final["result"]["code"] == "worker_lost"
    assert final["result"]["termination"] == "lost"
    # Its tenant's quota slot and its queue's in-flight slot came back with it.
    assert pair.redis.scard(keys.tenant_active(agent.tenant)) == 0
    assert not pair.redis.sismember(keys.inflight(keys.SHELL_QUEUE), task_id)

    # A replacement child appears; neither it nor the other worker runs the command again: the
    # broker holds no message of the call that it could deliver (acked on receipt).
    wait_until(lambda: pool_children(victim_main), 60, "celery to replace the pool child")
    assert broker_messages_of(pair, task_id) == 0
    assert (agent.workspace / "runs.txt").read_text() == "run\n"
    assert agent.get(task_id).json()["status"] == "lost"
    assert int(task_field(pair, task_id, "attempts") or 0) == 1

    # A retry with the same key replays the first response and runs nothing.
    retry = post_shell(agent, command, key=key, call_id=call_id)
    assert retry.status_code == accepted.status_code and retry.content == accepted.content
    assert retry.headers.get("Idempotent-Replayed") == "true"
    again = watch_all(agent, task_id)
    assert [e for e in again if e["type"] == "exit"][0]["status"] == "lost"
    assert broker_messages_of(pair, task_id) == 0  # the replay queued nothing
    assert (agent.workspace / "runs.txt").read_text() == "run\n"
    print(f"\n[faults] shell SIGKILL: stream ended {stream_end_s:.1f} s, GET lost {lost_s:.1f} s, "
          f"sandbox gone {gone_s:.1f} s after the kill (lease 3 s); runs=1")


def broker_messages_of(info: StackInfo, task_id: str) -> int:
    """Messages of a call that the broker could still deliver: waiting in a queue (kombu's Redis
    lists, one per priority), or delivered and not acked (its `unacked` hash, reserved ones too)."""
    found = sum(task_id.encode() in message for message in info.redis.hvals("unacked"))
    for key in info.redis.scan_iter(match=f"{keys.SHELL_QUEUE}*"):
        if info.redis.type(key) == b"list":
            found += sum(task_id.encode() in message for message in info.redis.lrange(key, 0, -1))
    return found


def watch_all(agent: Agent, task_id: str) -> list[dict[str, Any]]:
    ws = connect(agent, task_id)
    try:
        return collect(ws).events
    finally:
        ws.close()


# --- 3. warm shutdown with calls queued -------------------------------------------------------------

@pytest.mark.timeout(120)
def test_warm_shutdown_leaves_queued_calls_to_the_other_worker(tmp_path: Path) -> None:
    info, workspaces = own_stack(tmp_path, workers=2, concurrency=1)
    try:
        agent = new_agent(info)
        mains = worker_mains(info)
        (name_a, worker_a), (name_b, worker_b) = sorted(mains.items())
        task_ids = []
        for i in range(10):
            response = post_shell(agent, f"sleep 1; echo call {i}")
            assert response.status_code == 202, response.text
            task_ids.append(response.json()["task_id"])
        # Wait until worker A is busy with a call (and so has reserved the next one), then stop it.
        wait_until(lambda: any(task_field(info, t, "worker") == f"{socket.gethostname()}:{worker_a.pid}"
                               and task_field(info, t, "status") == "running" for t in task_ids),
                   30, "worker A to run a call")
        queued_at_stop = sum(task_field(info, t, "status") == "queued" for t in task_ids)
        worker_a.send_signal(signal.SIGTERM)  # warm shutdown: finish the running call, give back the rest
        stopped_at = time.monotonic()
        assert worker_a.wait(30) == 0
        print(f"\n[faults] warm shutdown: worker A exited {time.monotonic() - stopped_at:.1f} s after SIGTERM, "
              f"{queued_at_stop} calls queued at the time")
        results = [terminal(agent, t, 60) for t in task_ids]
        served_s = time.monotonic() - stopped_at
        assert [r["status"] for r in results] == ["completed"] * len(task_ids), results
        assert [r["result"]["stdout"] for r in results] == [f"call {i}\n" for i in range(len(task_ids))]
        by_worker: dict[str, int] = {}
        for t in task_ids:
            by_worker[task_field(info, t, "worker")] = by_worker.get(task_field(info, t, "worker"), 0) + 1
        assert f"{socket.gethostname()}:{worker_b.pid}" in by_worker
        print(f"[faults] warm shutdown: all {len(task_ids)} calls completed {served_s:.1f} s after SIGTERM; "
              f"per worker {sorted(by_worker.values())}")
    finally:
        info.stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)


# --- 4. Redis restarted -------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_redis_restart_503_then_recovers(tmp_path: Path) -> None:
    redis_stack = devstack.Stack()
    port = devstack.free_port()
    redis_url = devstack.start_redis(redis_stack, tmp_path / "redis", port=port)
    info, workspaces = own_stack(tmp_path, workers=1, concurrency=2, redis_url=redis_url)
    try:
        agent = new_agent(info)
        before = agent.shell("echo before", wait=30)
        assert before.status_code == 200 and before.json()["result"].get("stdout") == "before\n", before.text
        long = post_shell(agent, "echo begin; sleep 6; echo end")
        assert long.status_code == 202
        long_id = long.json()["task_id"]
        wait_until(lambda: task_field(info, long_id, "status") == "running", 20, "the long call to run")

        redis_stack.stop()
        answers = []
        for _ in range(3):  # a POST, a GET and /readyz, three times over: each one a 503
            for response in (post_shell(agent, "echo during"), agent.get(long_id),
                             agent.http.get(f"{info.base_url}/readyz", timeout=30)):
                answers.append(response)
                assert response.status_code == 503, (response.status_code, response.text)
                assert response.headers["Content-Type"] == "application/problem+json"
                assert response.json()["code"] == "unavailable"
                assert "Traceback" not in response.text and "redis://" not in response.text

        # Same port, same password, empty data: what a restart without persistence gives.
        devstack.start_redis(redis_stack, tmp_path / "redis", port=port, password=urlparse(redis_url).password)
        up_at = time.monotonic()
        wait_until(lambda: devstack.http_ok(f"{info.base_url}/readyz"), 60, "/readyz to answer 200 again", 0.2)
        ready_s = time.monotonic() - up_at
        after = agent.shell("echo after", wait=30)
        assert after.status_code == 200, after.text
        assert after.json()["status"] == "completed" and after.json()["result"]["stdout"] == "after\n"
        agent.workspace.mkdir(parents=True, exist_ok=True)
        sha = agent.write("after.txt", b"written after the restart\n")
        read = agent.call("read_file", {"path": "after.txt"})
        assert read.status_code == 200 and read.json()["result"]["sha"] == sha
        serving_s = time.monotonic() - up_at

        # The call that ran across the outage is never reported completed: once its worker is done
        # with it, its record is what the restart left, nothing (a restart without persistence).
        worker_log = info.logs / "worker0.log"
        wait_until(lambda: any(f"[{long_id}] {end}" in worker_log.read_text(errors="replace")
                               for end in ("succeeded", "raised")), 60, "the worker to be done with the long call")
        response = agent.get(long_id)
        assert response.status_code == 404 and response.json()["code"] == "not_found", response.text
        print(f"\n[faults] redis restart: {len(answers)} answers during the outage, all 503 unavailable; "
              f"/readyz 200 {ready_s:.1f} s and calls served {serving_s:.1f} s after Redis came back; "
              f"call across the outage: {response.status_code} {response.json()['code']}")
        assert info.stack.died() is None  # workers and API rode it out; nothing had to be restarted
        api_log = (info.logs / "api.log").read_text(errors="replace")
        assert "Traceback" not in api_log, api_log[-3000:]
    finally:
        info.stack.stop()
        redis_stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)


def parse_frames(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """Server-to-client WebSocket frames (unmasked); raises on anything that is not a valid frame."""
    frames, i = [], 0
    while len(data) - i >= 2:
        first, second = data[i], data[i + 1]
        assert first & 0x70 == 0 and first & 0x0F in (0x1, 0x2, 0x8, 0x9, 0xA), \
            f"not a WebSocket frame: {data[i:i + 80]!r}"
        length, header = second & 0x7F, 2
        if length == 126:
            length, header = int.from_bytes(data[i + 2:i + 4], "big"), 4
        elif length == 127:
            length, header = int.from_bytes(data[i + 2:i + 10], "big"), 10
        if len(data) - i < header + length:
            break
        frames.append((first & 0x0F, data[i + header:i + header + length]))
        i += header + length
    return frames, data[i:]


@pytest.mark.timeout(90)
def test_stream_closes_cleanly_when_redis_goes_away(tmp_path: Path) -> None:
    redis_stack = devstack.Stack()
    redis_url = devstack.start_redis(redis_stack, tmp_path / "redis")
    info, workspaces = own_stack(tmp_path, workers=1, concurrency=1, redis_url=redis_url)
    try:
        agent = new_agent(info)
        response = post_shell(agent, "echo hi; sleep 20")
        assert response.status_code == 202
        sock = raw_upgrade(agent, response.json()["task_id"])
        received = b""
        while b"hi" not in received:
            received += sock.recv(4096)
        redis_stack.stop()
        stopped_at = time.monotonic()
        frames: list[tuple[int, bytes]] = []
        sock.settimeout(60)  # a stream that never tells its client fails here, on TimeoutError
        while not any(opcode == 0x8 for opcode, _ in frames):
            chunk = sock.recv(65536)
            assert chunk, f"the server hung up without a close frame: {received[-300:]!r}"
            received += chunk
            frames, _ = parse_frames(received)  # every byte on the socket is a WebSocket frame
        sock.close()
        # The client learns the stream was interrupted (1011), not that it ended (1000): it resumes with after_seq.
        [close] = [payload for opcode, payload in frames if opcode == 0x8]
        assert int.from_bytes(close[:2], "big") == 1011, close
        print(f"\n[faults] stream during a Redis outage ended {time.monotonic() - stopped_at:.1f} s after the stop")
    finally:
        info.stack.stop()
        redis_stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)


# --- 5. two workers, one killed --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_two_workers_share_calls_and_survivor_serves_after_sigkill(tmp_path: Path) -> None:
    info, workspaces = own_stack(tmp_path, workers=2, concurrency=1)
    try:
        agents = [new_agent(info) for _ in range(4)]
        mains = worker_mains(info)
        (_, victim), (_, survivor) = sorted(mains.items())
        host = socket.gethostname()

        def run_batch(count: int, tag: str, *, gated: bool = False) -> list[str]:
            """`gated`: the calls wait for a file `go` in their workspace, made once both workers
            run one at the same time (so the spread does not hang on how fast each worker starts)."""
            ids = []
            for i in range(count):
                gate = "while [ ! -e go ]; do sleep 0.05; done; " if gated else ""
                response = post_shell(agents[i % len(agents)], f"{gate}sleep 0.2; echo {tag} {i}")
                assert response.status_code == 202, response.text
                ids.append(response.json()["task_id"])
            if gated:
                both = {f"{host}:{victim.pid}", f"{host}:{survivor.pid}"}
                wait_until(lambda: {task_field(info, t, "worker") for t in ids
                                    if task_field(info, t, "status") == "running"} == both, 60,
                           "both workers to run a call at once")
                for agent in agents:
                    agent.workspace.mkdir(parents=True, exist_ok=True)  # a queued call's may not exist yet
                    (agent.workspace / "go").touch()
            for i, task_id in enumerate(ids):
                body = terminal(agents[i % len(agents)], task_id, 60)
                assert body["status"] == "completed" and body["result"]["stdout"] == f"{tag} {i}\n", \
                    (body["status"], body.get("result"))  # the result says why, should it fail
            return [task_field(info, t, "worker") for t in ids]  # type: ignore[misc]

        spread = run_batch(20, "before", gated=True)
        counts = {w: spread.count(w) for w in set(spread)}
        assert set(counts) == {f"{host}:{victim.pid}", f"{host}:{survivor.pid}"}, counts

        group = victim.pid
        members = [victim.pid, *pool_children(victim.pid)]
        os.killpg(group, signal.SIGKILL)  # the main and its pool children, at once
        killed_at = time.monotonic()
        victim.wait(30)
        wait_until(lambda: not any(alive(pid) for pid in members), 30, "the killed worker's processes to go")
        after = run_batch(10, "after")
        recovered_s = time.monotonic() - killed_at
        assert set(after) == {f"{host}:{survivor.pid}"}
        assert devstack.http_ok(f"{info.base_url}/readyz")
        print(f"\n[faults] two workers: 20 calls spread {sorted(counts.values())}; after SIGKILL of one worker "
              f"(main + {len(members) - 1} children) 10 new calls completed on the survivor in {recovered_s:.1f} s")
    finally:
        info.stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)
