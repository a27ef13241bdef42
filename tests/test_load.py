"""Bounded load on a real stack: many calls, many tenants, many stream clients, an output flood.

Figures (throughput, latency, memory) are printed; run with `-s` to see them.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import websocket

from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack
from tests.streams import Received, collect, connect, raw_upgrade, watch

TERMINAL = {"completed", "failed", "cancelled", "lost"}


def _children(pid: int, needle: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in (b"Z", b"X") and needle in argv:
            found.append(int(entry))
    return sorted(found)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def api_worker_pid(info: StackInfo) -> int:
    [master] = [p for name, p in info.stack.children if name == "api"]
    [worker] = _children(master.pid, b"gunicorn")
    return worker


class RssSampler:
    """Peak VmRSS of one process, sampled in the background."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s = pid, every_s
        self.start = self.peak = rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except (OSError, AssertionError):
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def new_agent(info: StackInfo, tenant: str | None = None) -> Agent:
    return Agent(info, tenant or f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])


def start_call(agent: Agent, command: str) -> str:
    response = agent.shell(command, wait=None)
    assert response.status_code == 202, response.text
    return response.json()["task_id"]


def final(agent: Agent, task_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = agent.get(task_id).json()
        if body["status"] in TERMINAL:
            return body
        time.sleep(0.05)
    raise AssertionError(f"{task_id} did not finish")


def check_stream(received: Received, expected: bytes) -> None:
    received.check_sequence()
    assert received.close_code == 1000
    assert received.exit["status"] == "completed" and received.exit["exit_code"] == 0
    assert received.bytes_of("stdout") == expected
    assert received.exit["stdout_bytes"] == len(expected)
    assert received.exit["stdout_sha256"] == hashlib.sha256(expected).hexdigest()


@pytest.fixture(scope="module")
def load_stack(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """2 worker mains x concurrency 2: four pool processes."""
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("load"), workers=2, concurrency=2,
                       RUNWARDEN_WORKSPACES=str(workspaces))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


# --- 200 concurrent calls from 20 tenants ---------------------------------------------------------

@pytest.mark.timeout(150)
def test_200_concurrent_calls_from_20_tenants_all_complete_byte_exact(load_stack: StackInfo) -> None:
    agents = [new_agent(load_stack) for _ in range(20)]
    calls = []  # (agent, command, expected stdout)
    for i in range(200):
        agent = agents[i % 20]
        text = f"{agent.tenant}/{agent.run_id} call {i:03d} \u2713 \u00e9\u4f60\n"
        command = f"printf '%s' '{text}'; head -c 20000 /dev/zero | tr '\\0' a"
        calls.append((agent, command, text.encode() + b"a" * 20000))

    started = time.monotonic()
    with ThreadPoolExecutor(50) as pool:
        task_ids = list(pool.map(lambda c: start_call(c[0], c[1]), calls))
    accepted_s = time.monotonic() - started
    assert len(set(task_ids)) == 200

    def follow(index: int) -> float:
        agent, _, expected = calls[index]
        check_stream(watch(agent, task_ids[index], timeout=90), expected)
        return time.monotonic() - started

    with ThreadPoolExecutor(50) as pool:
        ends = sorted(pool.map(follow, range(200)))
    total_s = time.monotonic() - started
    results = [final(agent, task_id) for (agent, _, _), task_id in zip(calls, task_ids)]
    assert [r["status"] for r in results] == ["completed"] * 200
    for (_, _, expected), result in zip(calls, results):
        assert result["result"]["stdout_sha256"] == hashlib.sha256(expected).hexdigest()
        assert result["result"]["stdout_bytes"] == len(expected)
    workers = {load_stack.redis.hget(f"rw:task:{t}", "worker") for t in task_ids}
    assert len(workers) == 2  # both worker mains served
    print(f"\n[load] 200 calls / 20 tenants / 4 worker processes: accepted in {accepted_s:.1f} s, "
          f"all streams ended in {total_s:.1f} s ({200 / total_s:.0f} calls/s); stream end p50 "
          f"{ends[99]:.1f} s, p95 {ends[189]:.1f} s, max {ends[-1]:.1f} s; 200/200 sha256 match")


# --- many watchers, stalled readers, API memory ------------------------------------------------------

def stalled_reader(info: StackInfo, agent: Agent, task_id: str) -> socket.socket:
    """A client that does the WebSocket handshake and then never reads a byte (a slow phone)."""
    return raw_upgrade(agent, task_id, receive_buffer=16384)


def collect_safely(ws: websocket.WebSocket) -> Received | str:
    try:
        return collect(ws)
    except Exception as exc:  # noqa: BLE001 - reported as a failed stream, with the reason
        return f"{type(exc).__name__}: {exc}"[:300]
    finally:
        ws.close()


def readers_scenario(info: StackInfo, watchers: int, stalled_count: int) -> dict[str, Any]:
    """A ~20 MB call with `stalled_count` clients that never read plus one ordinary reader, and a
    small call followed by `watchers` clients; both calls wait for a file until every client has
    connected, so all are connected and waiting at once. Returns what each reader got and the API's RSS."""
    agent = new_agent(info)
    api_pid = api_worker_pid(info)
    sampler = RssSampler(api_pid)
    line = b"runwarden load test line, 32 b\n"
    size = 20_000_000
    big_expected = (line * (size // len(line) + 1))[:size]
    gate = "while [ ! -e go ]; do sleep 0.05; done"
    big = start_call(agent, f"{gate}; yes '{line[:-1].decode()}' | head -c {size}")
    ticks = start_call(agent, f"{gate}; for i in $(seq 1 40); do echo tick $i; sleep 0.02; done")
    ticks_expected = b"".join(b"tick %d\n" % i for i in range(1, 41))
    stalled = [stalled_reader(info, agent, big) for _ in range(stalled_count)]
    try:
        ordinary = connect(agent, big, timeout=60)
        watching = [connect(agent, ticks, timeout=60) for _ in range(watchers)]
        agent.workspace.mkdir(parents=True, exist_ok=True)
        (agent.workspace / "go").touch()
        started = time.monotonic()
        with ThreadPoolExecutor(watchers + 1) as pool:
            big_future = pool.submit(collect_safely, ordinary)
            tick_streams = list(pool.map(collect_safely, watching))
            watchers_s = time.monotonic() - started
            big_stream = big_future.result()
            ordinary_s = time.monotonic() - started
        peak = sampler.stop()
    finally:
        sampler.stop()
        for sock in stalled:
            sock.close()
    failures = [r for r in tick_streams if isinstance(r, str)]
    return {"agent": agent, "big": big, "big_stream": big_stream, "big_expected": big_expected,
            "tick_streams": tick_streams, "ticks_expected": ticks_expected, "failures": failures,
            "before": sampler.start, "peak": peak, "after": rss_mib(api_pid),
            "watchers_s": watchers_s, "ordinary_s": ordinary_s}


@pytest.mark.timeout(120)
def test_100_watchers_and_50_stalled_readers_all_streams_complete(load_stack: StackInfo) -> None:
    """Every stream completes byte for byte, the 20 MB one its stalled readers never read
    included, and the API survives them (its memory is bench/'s to measure, not a test's)."""
    api_pid = api_worker_pid(load_stack)
    run = readers_scenario(load_stack, watchers=100, stalled_count=50)
    print(f"\n[load] 100 watchers + 50 stalled + 1 reader: {len(run['failures'])} watcher streams failed "
          f"{sorted(set(run['failures']))[:3]}; API RSS {run['before']:.0f} -> peak {run['peak']:.0f} MiB")
    assert run["failures"] == []
    for received in run["tick_streams"]:
        check_stream(received, run["ticks_expected"])
    assert not isinstance(run["big_stream"], str), run["big_stream"]
    check_stream(run["big_stream"], run["big_expected"])  # the same 20 MB call, read in full
    assert final(run["agent"], run["big"])["status"] == "completed"
    # The API's process rode it out (not restarted by gunicorn) and still answers once the stalled clients are gone.
    assert api_worker_pid(load_stack) == api_pid and load_stack.stack.died() is None
    assert run["agent"].shell("echo still here", wait=30).json()["result"]["stdout"] == "still here\n"


# --- output flood with a small cap ------------------------------------------------------------------

CAP = 1_048_576


@pytest.fixture(scope="module")
def capped_stack(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("cap"), workers=1, concurrency=1,
                       RUNWARDEN_WORKSPACES=str(workspaces), RUNWARDEN_OUTPUT_CAP=str(CAP))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["yes", "while :; do cat flood.bin; done"], ids=["text", "binary"])
def test_output_flood_stops_at_cap(capped_stack: StackInfo, command: str) -> None:
    """An endless flood, of text or of random bytes (a file written here, so the bytes expected are
    known), is stopped at the cap: exactly the first CAP bytes, then the exit event says truncated.
    The worker's pool child survives it (its memory is bench/'s to measure)."""
    agent = new_agent(capped_stack)
    unit = b"y\n" if command == "yes" else os.urandom(300_000)
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "flood.bin").write_bytes(unit)
    expected = (unit * (CAP // len(unit) + 1))[:CAP]
    [main] = [p for name, p in capped_stack.stack.children if name.startswith("w")]
    [child] = _children(main.pid, b"celery")
    sampler = RssSampler(child, 0.02)
    started = time.monotonic()
    task_id = start_call(agent, command)
    received = watch(agent, task_id, timeout=60)
    elapsed = time.monotonic() - started
    peak = sampler.stop()
    received.check_sequence()
    assert received.close_code == 1000
    exit_event = received.exit
    assert exit_event["truncated"] is True
    assert received.bytes_of("stdout") == expected
    assert exit_event["stdout_bytes"] == CAP and exit_event["stdout_sha256"] == hashlib.sha256(expected).hexdigest()
    body = final(agent, task_id)
    assert body["status"] == "completed" and body["result"]["truncated"] is True
    assert body["result"]["stdout_bytes"] == CAP
    assert _children(main.pid, b"celery") == [child]  # the same pool child: not killed, not recycled
    print(f"\n[load] flood `{command}` with cap {CAP}: stopped at {exit_event['stdout_bytes']} bytes, "
          f"exit {exit_event['exit_code']} {exit_event['signal']}, {elapsed:.2f} s; worker child RSS "
          f"{sampler.start:.0f} -> peak {peak:.0f} MiB")
