"""Open streams at scale on the real stack (issue 19) and the API's drain and death (contract section 12).

Hundreds of streams held open by one API process (an asyncio client, so the test itself is not the
limit) while /healthz answers; shedding beyond RUNWARDEN_MAX_STREAMS; a client that stops reading is
dropped; SIGTERM drains; SIGKILL loses nothing a client cannot resume on another API process.
"""
from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import websockets
from websockets.asyncio.client import ClientConnection

from runwarden import devstack
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack
from tests.streams import Received, collect, connect, raw_upgrade
from tests.waiting import cancel, wait_until

MAX_STREAMS = 260
SEND_TIMEOUT_S = 3
DRAIN_S = 4
LONE_DRAIN_S = 15  # long enough for a released call to end on a loaded machine before the drain is over
GATE = "until [ -e {gate} ]; do sleep 0.1; done"


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("wide"), RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_MAX_STREAMS=str(MAX_STREAMS), RUNWARDEN_STREAM_SEND_TIMEOUT=str(SEND_TIMEOUT_S),
                       RUNWARDEN_DRAIN_S=str(DRAIN_S), RUNWARDEN_TENANT_MAX_RUNNING="1000",
                       RUNWARDEN_RATE_LIMIT="100000")
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


def new_agent(info: StackInfo) -> Agent:
    return Agent(info, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])


def post(agent: Agent, command: str) -> str:
    response = agent.shell(command, wait=None, timeout_ms=60000)
    assert response.status_code == 202, response.text
    return str(response.json()["task_id"])


def open_count(info: StackInfo) -> float:
    for line in requests.get(f"{info.base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("runwarden_streams_open "):
            return float(line.split()[1])
    raise AssertionError("no runwarden_streams_open in /metrics")


def healthz(info: StackInfo) -> int:
    return requests.get(f"{info.base_url}/healthz", timeout=60).status_code


def handshake(info: StackInfo, agent: Agent, task_id: str) -> tuple[int, dict[str, str], bytes]:
    host, port = info.base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("GET", f"/v1/tool-calls/{task_id}/stream", headers={
            "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Authorization": f"Bearer {agent.token}"})
        response = connection.getresponse()
        body = b"" if response.status == 101 else response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        connection.close()


# --- many streams, one process: asyncio clients -------------------------------------------------------

async def open_stream(agent: Agent, task_id: str) -> ClientConnection:
    return await websockets.connect(f"{agent.stack.ws_base}/v1/tool-calls/{task_id}/stream", open_timeout=60,
                                    additional_headers={"Authorization": f"Bearer {agent.token}"},
                                    ping_interval=None, max_size=None)


async def read_all(ws: ClientConnection) -> Received:
    received = Received()
    try:
        async for message in ws:
            received.events.append(json.loads(message))
    except websockets.ConnectionClosed:
        pass
    received.close_code = ws.close_code
    return received


async def open_many(agent: Agent, task_ids: list[str]) -> list[ClientConnection]:
    limit = asyncio.Semaphore(50)  # handshakes in flight at once

    async def one(task_id: str) -> ClientConnection:
        async with limit:
            return await open_stream(agent, task_id)
    return list(await asyncio.gather(*(one(task_id) for task_id in task_ids)))


@pytest.mark.timeout(300)
def test_hundreds_of_open_streams_while_healthz_answers_then_each_ends_with_its_exit(wide: StackInfo) -> None:
    """250 streams of queued calls, open at once: the API still answers /healthz and calls, holds
    them in one process, and every stream ends with its exit event once its call is cancelled."""
    agents = [new_agent(wide) for _ in range(5)]
    gate = f"go-{uuid.uuid4().hex[:8]}"
    calls = [(agent, post(agent, GATE.format(gate=gate))) for agent in agents for _ in range(50)]

    async def scenario() -> list[Received]:
        streams: list[ClientConnection] = []
        for agent in agents:
            streams += await open_many(agent, [task_id for owner, task_id in calls if owner is agent])
        assert len(streams) == 250
        await wait_for(lambda: open_count(wide) >= 250, "the API to count 250 open streams")
        for _ in range(5):  # while they are open: health, and what needs the API and Redis alone
            assert await asyncio.to_thread(healthz, wide) == 200
        owner, task_id = calls[-1]
        looked_up = await asyncio.to_thread(owner.get, task_id)
        assert looked_up.status_code == 200 and looked_up.json()["status"] in ("queued", "running")
        readers = [asyncio.create_task(read_all(ws)) for ws in streams]
        await asyncio.to_thread(lambda: [cancel(agent, task_id) for agent, task_id in calls])
        return list(await asyncio.wait_for(asyncio.gather(*readers), 120))

    received = asyncio.run(scenario())
    for got in received:
        assert [e["type"] for e in got.events][-1:] == ["exit"] and got.exit["status"] in ("cancelled", "completed")
        got.check_sequence()
        assert got.close_code == 1000
    wait_until(lambda: open_count(wide) == 0, 60, "every stream to be closed")


async def wait_for(check: Any, what: str) -> None:
    for _ in range(600):
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(300)
def test_a_handshake_beyond_the_limit_is_503_and_streams_are_admitted_again_once_others_close(
        wide: StackInfo) -> None:
    agent = new_agent(wide)
    gate = f"go-{uuid.uuid4().hex[:8]}"
    task_id = post(agent, GATE.format(gate=gate) + "; echo through")

    async def scenario() -> tuple[list[tuple[int, dict[str, str], bytes]], list[Received]]:
        streams = await open_many(agent, [task_id] * MAX_STREAMS)  # watchers of one call count alike
        await wait_for(lambda: open_count(wide) >= MAX_STREAMS, "the API to count its maximum of streams")
        refused = [await asyncio.to_thread(handshake, wide, agent, task_id) for _ in range(3)]
        for ws in streams[:10]:
            await ws.close()
        await wait_for(lambda: handshake_admitted(wide, agent, task_id), "a stream to be admitted again")
        readers = [asyncio.create_task(read_all(ws)) for ws in streams[10:]]
        agent.workspace.mkdir(parents=True, exist_ok=True)
        (agent.workspace / gate).touch()
        return refused, list(await asyncio.wait_for(asyncio.gather(*readers), 120))

    refused, received = asyncio.run(scenario())
    for status, headers, body in refused:
        assert status == 503 and headers["content-type"] == "application/problem+json", (status, body)
        assert headers["retry-after"].isdigit() and json.loads(body)["code"] == "unavailable"
    for got in received:
        assert got.bytes_of("stdout") == b"through\n" and got.exit["exit_code"] == 0 and got.close_code == 1000


def handshake_admitted(info: StackInfo, agent: Agent, task_id: str) -> bool:
    status, _, _ = handshake(info, agent, task_id)  # a 101 whose socket closes at once: freed again
    assert status in (101, 503), status
    return status == 101


# --- a client that stops reading -----------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_a_client_that_stops_reading_is_dropped_and_the_call_and_other_readers_go_on(wide: StackInfo) -> None:
    agent = new_agent(wide)
    gate = f"go-{uuid.uuid4().hex[:8]}"
    size = 30_000_000
    task_id = post(agent, GATE.format(gate=gate) + f"; head -c {size} /dev/zero | tr '\\0' y")
    stalled = raw_upgrade(agent, task_id, receive_buffer=4096)  # reads nothing from here on
    reader = connect(agent, task_id)
    api_log = wide.logs / "api.log"
    logged = api_log.stat().st_size
    try:
        before = open_count(wide)
        agent.workspace.mkdir(parents=True, exist_ok=True)
        (agent.workspace / gate).touch()
        received = collect(reader)
        # Dropped after RUNWARDEN_STREAM_SEND_TIMEOUT (not by the later ping timeout): the server
        # resets it instead of holding its backlog.
        wait_until(lambda: DROPPED in api_log.read_bytes()[logged:], 60, "the stalled client to be dropped")
        wait_until(lambda: open_count(wide) <= before - 2, 60, "the stalled client's stream to be gone")
        assert drained_to_reset(stalled)
    finally:
        reader.close()
        stalled.close()
    assert received.bytes_of("stdout") == b"y" * size and received.exit["exit_code"] == 0
    assert received.close_code == 1000


DROPPED = b"dropping a stream whose client stopped reading"


def drained_to_reset(sock: socket.socket) -> bool:
    """Read what the kernel holds for a dropped client: it ends in a reset or EOF, never a close frame 1000."""
    sock.settimeout(60)
    tail = b""
    try:
        while chunk := sock.recv(1 << 20):
            tail = (tail + chunk)[-8:]
    except ConnectionResetError:
        return True
    return not tail.endswith(b"\x88\x02\x03\xe8")  # an unmasked close frame with code 1000


# --- SIGTERM drains, SIGKILL loses nothing --------------------------------------------------------------

def api_process(info: StackInfo) -> subprocess.Popen[bytes]:
    [api] = [process for name, process in info.stack.children if name.startswith("api")]
    return api


def second_api(info: StackInfo) -> StackInfo:
    """Another API process on the same Redis and workers, on its own port."""
    port = devstack.free_port()
    devstack.start_api(info.stack, info.env, "127.0.0.1", port, log=info.logs / f"api-{port}.log")
    moved = dataclasses.replace(info, base_url=f"http://127.0.0.1:{port}")
    wait_until(lambda: devstack.http_ok(f"{moved.base_url}/readyz"), 90, "the second API to serve")
    return moved


@pytest.fixture
def lone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """A stack of its own: its API is stopped or killed."""
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("lone"), RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_DRAIN_S=str(LONE_DRAIN_S))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


def refused(info: StackInfo) -> bool:
    host, port = info.base_url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.timeout(180)
def test_sigterm_drains_ending_calls_get_their_exit_the_rest_1001_and_resume_elsewhere(lone: StackInfo) -> None:
    agent = new_agent(lone)
    ends, stays = f"ends-{uuid.uuid4().hex[:6]}", f"stays-{uuid.uuid4().hex[:6]}"
    ending = post(agent, "echo one; " + GATE.format(gate=ends) + "; echo two")
    staying = post(agent, "echo three; " + GATE.format(gate=stays) + "; echo four")
    first, second = connect(agent, ending), connect(agent, staying)
    try:
        head_first, head_second = collect(first, limit=1), collect(second, limit=1)
        api = api_process(lone)
        os.killpg(api.pid, signal.SIGTERM)
        wait_until(lambda: refused(lone), 30, "new connections to be refused during the drain")
        agent.workspace.mkdir(parents=True, exist_ok=True)
        (agent.workspace / ends).touch()
        rest_first = collect(first)  # its call ends during the drain: exit event, then 1000
        rest_second = collect(second)  # its call does not: 1001 once RUNWARDEN_DRAIN_S is over
    finally:
        first.close()
        second.close()
    assert head_first.bytes_of("stdout") + rest_first.bytes_of("stdout") == b"one\ntwo\n"
    assert rest_first.exit["exit_code"] == 0 and rest_first.close_code == 1000
    assert rest_second.close_code == 1001 and not any(e["type"] == "exit" for e in rest_second.events)
    assert api.wait(60) == 0  # the API exited by itself once drained

    moved = second_api(lone)
    resumed = Agent(moved, agent.tenant, agent.run_id, ALL_SCOPES, ["**"])
    last = (head_second.events + rest_second.events)[-1]["seq"]
    (agent.workspace / stays).touch()
    tail = connect(resumed, staying, after_seq=last)
    try:
        rest = collect(tail)
    finally:
        tail.close()
    events = head_second.events + rest_second.events + rest.events
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert b"".join(e["data"].encode() for e in events if e["type"] == "output") == b"three\nfour\n"
    assert rest.exit["exit_code"] == 0 and rest.close_code == 1000


@pytest.mark.timeout(180)
def test_api_killed_with_open_streams_clients_resume_on_another_api_without_gap_or_duplicate(
        lone: StackInfo) -> None:
    agent = new_agent(lone)
    gate = f"go-{uuid.uuid4().hex[:6]}"
    lines = 3
    # Some output before the kill, more after it: each line waits for its own file.
    script = "; ".join(f"echo line {n}; until [ -e {gate}.{n} ]; do sleep 0.05; done" for n in range(lines))
    tasks = [post(agent, script + "; echo last") for _ in range(2)]  # one on each pool process
    clients = [connect(agent, task_id) for task_id in tasks]
    heads = [collect(ws, limit=1) for ws in clients]
    os.killpg(api_process(lone).pid, signal.SIGKILL)
    for ws in clients:
        with pytest.raises(Exception):  # noqa: B017 - whatever the client library makes of a dead peer
            collect(ws)
        ws.close()
    moved = second_api(lone)
    resumed = Agent(moved, agent.tenant, agent.run_id, ALL_SCOPES, ["**"])
    agent.workspace.mkdir(parents=True, exist_ok=True)
    for n in range(lines):
        (agent.workspace / f"{gate}.{n}").touch()
    for task_id, head in zip(tasks, heads):
        tail = connect(resumed, task_id, after_seq=head.events[-1]["seq"])
        try:
            rest = collect(tail)
        finally:
            tail.close()
        events = head.events + rest.events
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        expected = "".join(f"line {n}\n" for n in range(lines)) + "last\n"
        assert b"".join(e["data"].encode() for e in events if e["type"] == "output") == expected.encode()
        assert rest.exit["exit_code"] == 0 and rest.close_code == 1000
