"""Redis SIGKILLed and started again under load, with its append-only file on (fsync always), and
the API and worker processes as production runs them (contract sections 4 and 12).

Several clients make calls all along. While Redis is down every answer is a 503 (never a 500, and
never a hang: each request has a bound); once it is back the stack serves again by itself, nothing
has run twice (each shell call appends its key to a file), and what completed before the kill is
still there: its record, and its replay, byte for byte.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
import requests

from runwarden import devstack
from shared import keys
from shared.idempotency import Idempotency, Releases
from shared.settings import Settings
from shared.tenants import Quotas
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack

CLIENTS = 4
ANSWERS = {200, 202, 409, 503}
TERMINAL = {"completed", "failed", "cancelled", "lost"}


@dataclass
class Client:
    """One agent making shell calls one after another, as a careful client does: a 503 is retried
    with the same key, a 409 or a 202 waited out on GET."""

    agent: Agent
    codes: Counter[int] = field(default_factory=Counter)
    first: dict[str, requests.Response] = field(default_factory=dict)  # key → its first 200 or 202
    final: dict[str, dict] = field(default_factory=dict)  # key → the call's final record
    error: BaseException | None = None

    def post(self, key: str, call_id: str) -> requests.Response:
        headers = self.agent.headers(key, Prefer="wait=20")
        # The bound: a request that hangs fails the test here (ReadTimeout), it is never waited out.
        return self.agent.call("execute_shell_command", {"command": f"echo {key} >> runs.txt"}, key=key,
                               call_id=call_id, headers=headers)

    def one_call(self, deadline: float, stop: threading.Event) -> None:
        key, call_id = f"k-{uuid.uuid4()}", str(uuid.uuid4())
        while True:
            response = self.post(key, call_id)
            self.codes[response.status_code] += 1
            assert response.status_code in ANSWERS, (response.status_code, response.text)
            if response.status_code in (200, 202):
                break
            # 503: not the call's outcome; 409: an earlier attempt's call is still on its way (or its
            # claim, whose message never left, is being released): retry the same request.
            assert response.json()["code"] in ("unavailable", "idempotency_key_in_use"), response.text
            assert "Traceback" not in response.text
            assert time.monotonic() < deadline, f"still {response.status_code} long after Redis came back"
            if stop.is_set():
                # The test has its calls. This key's call may be one a worker had reserved when Redis
                # died, which its visibility timeout (120 s at least) gives back: left, not waited for.
                return
            time.sleep(0.1 if response.status_code == 503 else float(response.headers["Retry-After"]))
        self.first.setdefault(key, response)
        body = response.json()
        final = body if body["status"] in TERMINAL else self.wait_for_end(body["task_id"], deadline, stop)
        if final is not None:
            self.final[key] = final

    def wait_for_end(self, task_id: str, deadline: float, stop: threading.Event) -> dict | None:
        """Its final record; None if the test stopped first (as in one_call)."""
        while time.monotonic() < deadline and not stop.is_set():
            response = self.agent.get(task_id)
            self.codes[response.status_code] += 1
            assert response.status_code in (200, 503), (response.status_code, response.text)
            if response.status_code == 200 and response.json()["status"] in TERMINAL:
                return response.json()
            time.sleep(0.1)
        if stop.is_set():
            return None
        raise AssertionError(f"{task_id} did not end")

    def run(self, stop: threading.Event, deadline: float) -> None:
        try:
            while not stop.is_set():
                self.one_call(deadline, stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            self.error = exc


def runs_of(agent: Agent) -> Counter[str]:
    path = agent.workspace / "runs.txt"
    return Counter(path.read_text().split()) if path.exists() else Counter()


@pytest.mark.timeout(420)
def test_redis_sigkilled_under_load_recovers_and_runs_nothing_twice(tmp_path: Path) -> None:
    redis_stack, port = devstack.Stack(), devstack.free_port()
    redis_url = devstack.start_redis(redis_stack, tmp_path / "redis", port=port, appendonly=True)
    workspaces = reachable_workspaces()
    info: StackInfo = start_stack(tmp_path, workers=1, concurrency=2, redis_url=redis_url,
                                  RUNWARDEN_WORKSPACES=str(workspaces))
    clients = [Client(Agent(info, f"t{uuid.uuid4().hex[:10]}", "run", ALL_SCOPES, ["**"])) for _ in range(CLIENTS)]
    stop, deadline = threading.Event(), time.monotonic() + 300
    threads = [threading.Thread(target=c.run, args=(stop, deadline), daemon=True) for c in clients]
    try:
        for thread in threads:
            thread.start()
        done = lambda: sum(len(c.final) for c in clients)  # noqa: E731
        wait(lambda: done() >= 20, 120, "calls completed before the kill")
        before = {key: (c, c.final[key], c.first[key]) for c in clients for key in list(c.final)
                  if c.final[key]["status"] == "completed"}
        [(_, redis_process)] = redis_stack.children
        os.killpg(redis_process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        redis_process.wait(30)
        redis_stack.children.clear()
        wait(lambda: all(c.codes[503] for c in clients), 60, "every client to be answered 503 while Redis is down")
        devstack.start_redis(redis_stack, tmp_path / "redis", port=port, password=urlparse(redis_url).password,
                             appendonly=True)
        back_at = time.monotonic()
        after_restart = done()
        # Bounded generously: a call a worker had reserved when Redis died waits in kombu's unacked
        # set until the visibility timeout (120 s here) gives it back; on a loaded machine, later.
        def served_again() -> bool:
            assert (died := info.stack.died()) is None, f"{died}, where it was to ride it out"
            return done() >= after_restart + 20
        wait(served_again, 300, "calls completed after the restart")
        served_s = time.monotonic() - back_at
        stop.set()
        for thread in threads:
            thread.join(120)
        for client in clients:
            assert client.error is None, repr(client.error)

        codes = sum((c.codes for c in clients), Counter())
        assert set(codes) <= ANSWERS and codes[503] >= CLIENTS, codes
        for client in clients:  # nothing ran twice; what completed ran once
            runs = runs_of(client.agent)
            assert all(count == 1 for count in runs.values()), runs
            for key, record in client.final.items():
                if record["status"] == "completed":
                    assert runs[key] == 1, (key, record)
        for key, (client, record, first) in before.items():  # what completed before the kill is intact
            again = client.agent.get(record["task_id"]).json()
            assert again["status"] == "completed" and again["result"] == record["result"]
            replay = client.post(key, record["call_id"])
            assert replay.status_code == first.status_code and replay.content == first.content
            assert replay.headers.get("Idempotent-Replayed") == "true"
        assert info.stack.died() is None  # workers and API rode it out; nothing was restarted
        outcomes = Counter(r["status"] for c in clients for r in c.final.values())
        print(f"\n[faults] redis SIGKILL under load: {sum(codes.values())} answers {dict(codes)}; outcomes "
              f"{dict(outcomes)}; down {back_at - killed_at:.1f} s; 20 calls served {served_s:.1f} s after restart")
    finally:
        stop.set()
        info.stack.stop()
        redis_stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)


def wait(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_claim_whose_message_never_left_is_released_once_redis_is_back(tmp_path: Path) -> None:
    """Redis goes away between a claim and its message: the release fails too, and is made once
    Redis answers again (else every retry would get 409 for a call that never runs)."""
    redis_stack, port = devstack.Stack(), devstack.free_port()
    redis_url = devstack.start_redis(redis_stack, tmp_path / "redis", port=port, appendonly=True)
    settings = Settings.from_env({"RUNWARDEN_REDIS_URL": redis_url}, require_jwt=False)
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
    idempotency = Idempotency(client, 3600, 1000, Quotas.defaults(settings))
    tenant, key = f"t{uuid.uuid4().hex[:10]}", "never-sent"
    try:
        idempotency.claim(tenant=tenant, key=key, fp="fp", run_id="run", call_id=str(uuid.uuid4()),
                          tool_name="read_file", created_ms=int(time.time() * 1000), queue=keys.FILE_QUEUE)
        redis_stack.stop()  # the broker is gone before the message is sent
        releases = Releases(idempotency)
        releases.release(tenant, key)  # fails now: kept for later
        devstack.start_redis(redis_stack, tmp_path / "redis", port=port, password=urlparse(redis_url).password,
                             appendonly=True)
        assert client.exists(keys.idempotency(tenant, key))  # the append-only file kept the claim
        wait(lambda: not client.exists(keys.idempotency(tenant, key)), 60, "the claim to be released")
        assert not client.exists(keys.task(keys.task_id_for(tenant, key)))
    finally:
        redis_stack.stop()
