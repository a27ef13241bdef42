"""Operating runwarden (contract section 12): metrics on both sides, the audit trail, JSON logs.

One stack for the module (JSON logs on), so a metric's movement is this module's own: every
assertion is on the difference between two scrapes, read with prometheus-client's own parser.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from runwarden import devstack
from shared import tenants
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack
from tests.streams import collect, connect
from tests.test_deploy import dashboard_queries
from tests.test_faults import proc_table, worker_main_pid
from tests.waiting import cancel, ended, wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
GATE = "while [ ! -e go ]; do sleep 0.05; done"


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("ops"), RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_LOG_FORMAT="json")
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


def new_agent(info: StackInfo, scopes: list[str] | None = None, tenant: str | None = None) -> Agent:
    return Agent(info, tenant or f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}",
                 ALL_SCOPES if scopes is None else scopes, ["**"])


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus endpoint, parsed by prometheus-client's own parser."""
    response = requests.get(url, timeout=30)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def endpoints(info: StackInfo) -> tuple[str, str]:
    [worker] = [url for name, url in info.stack.metrics.items() if name != "api"]
    return info.stack.metrics["api"], worker


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def gated(agent: Agent, tag: str, key: str | None = None, call_id: str | None = None) -> str:
    """A shell call that waits for the file `go` in its workspace, then prints `tag`."""
    response = agent.call("execute_shell_command", {"command": f"{GATE}; echo {tag}"}, key=key, call_id=call_id)
    assert response.status_code == 202, response.text
    return response.json()["task_id"]


def status(info: StackInfo, task_id: str) -> str | None:
    value = info.redis.hget(f"rw:task:{task_id}", "status")
    return value.decode() if value else None


def open_gate(agent: Agent) -> None:
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "go").touch()


def test_every_family_moves_with_the_calls_on_the_side_that_measures_it(ops: StackInfo) -> None:
    api_url, worker_url = endpoints(ops)
    api0, worker0 = scrape(api_url), scrape(worker_url)
    agent, other = new_agent(ops), new_agent(ops)
    agent.write("f.txt", b"hello\n")  # apply_file_patch, completed
    assert agent.call("read_file", {"path": "f.txt"}).status_code == 200
    assert agent.call("read_file", {"path": "missing.txt"}).status_code == 404  # failed: file_not_found
    key = f"k-{uuid.uuid4()}"
    body = {"command": "printf abc; printf de >&2; exit 3"}
    first = agent.call("execute_shell_command", body, key=key, headers=agent.headers(key, Prefer="wait=30"))
    assert first.status_code == 200 and first.json()["result"]["exit_code"] == 3, first.text
    replay = agent.call("execute_shell_command", body, key=key, call_id=first.json()["call_id"])
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert agent.call("execute_shell_command", {"command": "true"}, key=key).status_code == 422  # reused

    # Both pool processes held, a stream open on one, a third call queued behind them.
    held_key, held_call = f"k-{uuid.uuid4()}", str(uuid.uuid4())
    held = [gated(agent, "one", key=held_key, call_id=held_call), gated(agent, "two")]
    wait_until(lambda: all(status(ops, t) == "running" for t in held), 60, "both pool processes to run a call")
    ws = connect(agent, held[0])
    wait_until(lambda: delta(scrape(api_url), api0, "runwarden_streams_open") == 1, 30, "the stream to count")
    retry = agent.call("execute_shell_command", {"command": f"{GATE}; echo one"}, key=held_key, call_id=held_call)
    assert retry.status_code == 409, retry.text
    queued = gated(agent, "three")
    tenants.set_overrides(ops.redis, other.tenant, {"max_running": 1})
    others = gated(other, "four")
    refused = other.call("execute_shell_command", {"command": "true"})
    assert refused.status_code == 429 and refused.json()["quota"] == "max_running", refused.text
    for owner, task_id in ((agent, queued), (other, others)):
        assert status(ops, task_id) == "queued"
        cancel(owner, task_id)  # the API ends them: cancelled
    open_gate(agent)
    assert [ended(agent, t)["status"] for t in held] == ["completed", "completed"]
    assert [e for e in collect(ws).events if e["type"] == "exit"]
    ws.close()
    wait_until(lambda: delta(scrape(api_url), api0, "runwarden_streams_open") == 0, 30, "the stream to be uncounted")
    api1, worker1 = scrape(api_url), scrape(worker_url)

    calls = "runwarden_tool_calls_total"
    shell, patch, read = "execute_shell_command", "apply_file_patch", "read_file"
    assert delta(worker1, worker0, calls, tool=patch, outcome="completed") == 1
    assert delta(worker1, worker0, calls, tool=read, outcome="completed") == 1
    assert delta(worker1, worker0, calls, tool=read, outcome="failed") == 1
    assert delta(worker1, worker0, calls, tool=shell, outcome="completed") == 3
    assert delta(api1, api0, calls, tool=shell, outcome="cancelled") == 2  # ended by the API's cancel
    for samples, before, tool, count in ((worker1, worker0, shell, 3), (worker1, worker0, read, 2),
                                         (worker1, worker0, patch, 1), (api1, api0, shell, 2)):
        assert delta(samples, before, "runwarden_tool_call_duration_seconds_count", tool=tool) == count
    for tool, count in ((shell, 3), (read, 2), (patch, 1)):  # the cancelled calls never started
        assert delta(worker1, worker0, "runwarden_queue_wait_seconds_count", tool=tool) == count
    assert delta(worker1, worker0, "runwarden_queue_wait_seconds_bucket", tool=shell, le="+Inf") == 3
    assert delta(worker1, worker0, "runwarden_stream_bytes_total", stream="stdout") == len("abc" "one\n" "two\n")
    assert delta(worker1, worker0, "runwarden_stream_bytes_total", stream="stderr") == len("de")
    idempotency = "runwarden_idempotency_total"
    assert delta(api1, api0, idempotency, result="claimed") == 8
    assert [delta(api1, api0, idempotency, result=r) for r in ("replayed", "in_use", "reused")] == [1, 1, 1]
    assert delta(api1, api0, "runwarden_quota_refusals_total", quota="max_running") == 1
    assert delta(worker1, worker0, "runwarden_sandbox_failures_total") == 0
    # Each side exports what it measures, and only that.
    api_only = {"runwarden_streams_open", "runwarden_idempotency_total", "runwarden_quota_refusals_total",
                "runwarden_http_requests_total"}
    worker_only = {"runwarden_queue_wait_seconds_count", "runwarden_stream_bytes_total",
                   "runwarden_sandbox_failures_total"}
    assert api_only <= names(api1) and not worker_only & names(api1)
    assert worker_only <= names(worker1) and not api_only & names(worker1)
    assert not any("tenant" in dict(labels) or agent.tenant in str(labels) for _, labels in api1 | worker1)


def test_a_real_prometheus_scrapes_the_api_and_the_worker(ops: StackInfo, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary here (.ci/run installs Debian's `prometheus` package)")
    api_url, worker_url = endpoints(ops)
    agent = new_agent(ops)
    assert agent.shell("echo scraped").json()["status"] == "completed"
    config = tmp_path / "prometheus.yml"
    targets = {"api": api_url, "worker": worker_url}
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [url.split("/")[2]]}]}
                           for job, url in targets.items()],
    }))
    port = devstack.free_port()
    stack = devstack.Stack()
    stack.start("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"], os.environ.copy(), tmp_path / "prom.log")

    def query(promql: str) -> dict[str, float]:
        try:
            answer = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": promql}, timeout=10)
        except requests.ConnectionError:
            return {}
        result = answer.json()["data"]["result"] if answer.status_code == 200 else []
        return {r["metric"].get("job", ""): float(r["value"][1]) for r in result}

    try:
        wait_until(lambda: query("up") == {"api": 1.0, "worker": 1.0}, 90, "Prometheus to scrape both", 0.5)
        calls = wait_until(lambda: query('sum by (job) (runwarden_tool_calls_total{outcome="completed"})'), 60,
                           "completed calls in Prometheus", 0.5)
        assert calls.get("worker", 0) >= 1, calls
        claimed = wait_until(lambda: query('sum by (job) (runwarden_idempotency_total{result="claimed"})'), 60,
                             "claims in Prometheus", 0.5)
        assert set(claimed) == {"api"}, claimed
        for expr in dashboard_queries():  # Prometheus itself accepts every query of the dashboard
            promql = expr.replace("$__rate_interval", "1m").replace("$__range", "5m")
            answer = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": promql}, timeout=10)
            assert answer.status_code == 200 and answer.json()["status"] == "success", (promql, answer.text)
    finally:
        stack.stop()


def audit_lines(agent: Agent, **params: str) -> list[dict[str, Any]]:
    response = requests.get(f"{agent.stack.base_url}/v1/audit", params=params, timeout=30,
                            headers={"Authorization": f"Bearer {agent.token}"})
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.splitlines()]


def test_audit_trail_records_every_accepted_call_with_its_outcome(ops: StackInfo) -> None:
    agent = new_agent(ops)
    auditor = Agent(ops, agent.tenant, "any-run", ["audit:read"], ["**"])
    started = datetime.now(timezone.utc)
    agent.write("a.txt", b"audited\n")
    assert agent.call("read_file", {"path": "missing.txt"}).status_code == 404
    long_command = "echo " + "x" * 300 + "; exit 2"
    shell = agent.shell(long_command).json()
    assert shell["result"]["exit_code"] == 2
    held = [gated(agent, "one"), gated(agent, "two")]
    wait_until(lambda: all(status(ops, t) == "running" for t in held), 60, "both pool processes to run a call")
    queued = gated(agent, "three")
    cancel(agent, queued)
    open_gate(agent)
    for task_id in held:
        ended(agent, task_id)

    records = audit_lines(auditor)  # in the order the calls ended
    assert [r["task_id"] for r in records][2:4] == [shell["task_id"], queued], records
    by_id = {r["task_id"]: r for r in records}
    assert len(records) == 6 and set(by_id) >= {shell["task_id"], queued, *held}
    patch, missing = records[0], records[1]
    assert (patch["tool"], patch["path"], patch["outcome"], patch["exit_code"]) == ("apply_file_patch", "a.txt",
                                                                                   "completed", None)
    assert (missing["tool"], missing["path"], missing["outcome"], missing["error"]) == (
        "read_file", "missing.txt", "failed", "file_not_found")
    audited_shell = by_id[shell["task_id"]]
    assert audited_shell["command"] == long_command[:256] and audited_shell["exit_code"] == 2
    assert audited_shell["outcome"] == "completed" and audited_shell["call_id"] == shell["call_id"]
    assert by_id[queued]["outcome"] == "cancelled" and by_id[queued]["queue_wait_ms"] is None
    for record in records:
        assert (record["tenant"], record["run_id"], record["sub"]) == (agent.tenant, agent.run_id, "agent-1")
        assert record["jti"] and record["idempotency_key"] and record["duration_ms"] >= 0
        assert datetime.fromisoformat(record["time"]) >= started.replace(microsecond=0)
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)  # oldest first

    assert audit_lines(auditor, limit="2") == records[:2]
    assert audit_lines(auditor, since="3600") == records
    assert audit_lines(auditor, since=records[2]["time"]) == records[2:]
    assert audit_lines(auditor, since="2999-01-01T00:00:00Z") == []
    stranger = Agent(ops, f"t{uuid.uuid4().hex[:10]}", "run", ["audit:read"], ["**"])
    assert audit_lines(stranger) == []  # another tenant's trail is its own
    no_scope = requests.get(f"{ops.base_url}/v1/audit", headers={"Authorization": f"Bearer {agent.token}"},
                            timeout=30)
    assert no_scope.status_code == 403 and no_scope.json()["code"] == "forbidden_scope"
    for bad in ("yesterday", "-5", "1" * 70):
        refused = requests.get(f"{ops.base_url}/v1/audit", params={"since": bad}, timeout=30,
                               headers={"Authorization": f"Bearer {auditor.token}"})
        assert refused.status_code == 400 and refused.json()["code"] == "schema_invalid", (bad, refused.text)

    cli = subprocess.run([sys.executable, "-m", "runwarden.cli", "audit", "--tenant", agent.tenant, "--since", "3600"],
                         env=devstack.child_env(RUNWARDEN_REDIS_URL=ops.redis_url), capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert [json.loads(line) for line in cli.stdout.splitlines()] == records


def pool_child_running(info: StackInfo, task_id: str, marker: bytes) -> int:
    """The pool process whose sandbox runs `sleep <marker>`: the sleeper's ancestor whose parent is
    the worker main that runs the call."""
    main = worker_main_pid(info, task_id)
    table = proc_table()
    [sleeper] = [pid for pid, (_, argv, _) in table.items() if argv == [b"sleep", marker]]
    pid = sleeper
    while table[pid][0] != main:
        pid = table[pid][0]
    return pid


def test_a_lost_call_is_counted_and_audited_once(ops: StackInfo) -> None:
    """SIGKILL the pool process running a call: whoever reaps it (the worker's reaper or the API)
    counts it lost once, and the audit trail says so."""
    api_url, worker_url = endpoints(ops)
    api0, worker0 = scrape(api_url), scrape(worker_url)
    agent = new_agent(ops, ALL_SCOPES + ["audit:read"])
    marker = f"40.{uuid.uuid4().int % 10**6:06d}"
    accepted = agent.call("execute_shell_command", {"command": f"sleep {marker}"})
    task_id = accepted.json()["task_id"]
    wait_until(lambda: any(argv == [b"sleep", marker.encode()] for _, argv, _ in proc_table().values()), 60,
               "the sandboxed sleep")
    os.kill(pool_child_running(ops, task_id, marker.encode()), signal.SIGKILL)
    assert ended(agent, task_id)["status"] == "lost"
    wait_until(lambda: audit_lines(agent), 30, "the audit record")
    [record] = audit_lines(agent)
    assert (record["task_id"], record["outcome"], record["error"]) == (task_id, "lost", "worker_lost")
    assert record["command"] == f"sleep {marker}"
    lost = "runwarden_tool_calls_total"
    counted = (delta(scrape(api_url), api0, lost, tool="execute_shell_command", outcome="lost")
               + delta(scrape(worker_url), worker0, lost, tool="execute_shell_command", outcome="lost"))
    assert counted == 1
    assert agent.shell("echo after").json()["status"] == "completed"  # the pool process was replaced


def json_objects(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a log (Celery's start banner and gunicorn's master write text before)."""
    return [json.loads(line) for line in path.read_text(errors="replace").splitlines() if line.startswith("{")]


def test_json_logs_follow_a_call_from_api_to_worker_and_hold_no_secret(ops: StackInfo) -> None:
    agent = new_agent(ops)
    in_file, in_output = (f"secret-{uuid.uuid4().hex}" for _ in range(2))
    agent.write("key.pem", in_file.encode())
    assert agent.call("read_file", {"path": "key.pem"}).json()["result"]["content"] == in_file
    shell = agent.shell(f"cat key.pem; echo {in_output[:7]}''{in_output[7:]}").json()
    assert shell["result"]["stdout"] == in_file + in_output + "\n"
    task_id = shell["task_id"]

    def worker_lines() -> list[dict[str, Any]]:  # Celery's "succeeded" line may follow the answer
        found = [line for line in json_objects(ops.logs / "worker0.log") if line.get("task_id") == task_id]
        return found if any("succeeded" in line["message"] for line in found) else []
    worker = wait_until(worker_lines, 30, "the worker's lines for the call")
    api = [line for line in json_objects(ops.logs / "api.log") if line.get("task_id") == task_id]
    assert api, "no API line names the call"
    for line in api + worker:  # the same call, followed by its fields
        assert (line["task_id"], line["call_id"], line["tenant"], line["sub"]) == (
            task_id, shell["call_id"], agent.tenant, "agent-1"), line
        assert {"time", "level", "logger", "message"} <= set(line)
    text = "".join(log.read_text(errors="replace") for log in ops.logs.glob("*.log"))
    for secret in (agent.token, ops.secret, in_file, in_output):
        assert secret not in text


def test_sandbox_failures_are_counted(tmp_path: Path) -> None:
    """A worker whose sandbox cannot be set up (its workspaces root is a file) counts the failed
    self-test and each shell call it refuses."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    info = start_stack(tmp_path, RUNWARDEN_WORKSPACES=str(blocked))
    try:
        _, worker_url = endpoints(info)
        agent = new_agent(info)
        answer = agent.shell("echo never").json()
        assert answer["status"] == "failed" and answer["result"]["code"] == "sandbox_unavailable", answer
        samples = scrape(worker_url)
        assert samples[("runwarden_sandbox_failures_total", frozenset())] == 2  # the self-test, the call
        key = ("runwarden_tool_calls_total", frozenset({"tool": "execute_shell_command", "outcome": "failed"}.items()))
        assert samples[key] == 1
    finally:
        info.stack.stop()


def test_flower_shows_each_call_as_a_summary_never_its_command(ops: StackInfo, tmp_path: Path) -> None:
    """Flower, started against the stack's broker as compose runs it, lists runwarden's tasks with
    the call's summary (tenant, run, call id, tool) as their args, and never the command."""
    pytest.importorskip("flower", reason="Flower is in the dev extra")
    port, stack = devstack.free_port(), devstack.Stack()
    stack.start("flower", [sys.executable, "-m", "celery", "-A", "workers.worker", "flower", "--address=127.0.0.1",
                           f"--port={port}"], {**ops.env, "FLOWER_UNAUTHENTICATED_API": "true"}, tmp_path / "flower.log")
    base, agent = f"http://127.0.0.1:{port}", new_agent(ops)
    try:
        wait_until(lambda: devstack.http_ok(f"{base}/healthcheck"), 60, "Flower to answer", 0.2)

        def a_call_flower_saw() -> tuple[str, str, dict[str, Any]] | None:
            """Task events are pub/sub: a call made (or sent) before Flower listens is not seen
            whole, so make calls until Flower has seen one from its start (name and args)."""
            secret = f"secret-{uuid.uuid4().hex}"
            task_id = agent.shell(f"echo {secret}").json()["task_id"]

            def seen_whole() -> dict[str, Any] | None:
                task = requests.get(f"{base}/api/tasks", timeout=10).json().get(task_id) or {}
                return task if task.get("name") and task.get("args") else None
            try:
                seen = wait_until(seen_whole, 5, "Flower to see the call", 0.2)
            except AssertionError:
                return None
            return task_id, secret, seen
        task_id, secret, seen = wait_until(a_call_flower_saw, 60, "a call Flower saw", 0)
        assert seen["name"] == "runwarden.execute_shell_command"
        assert f"'tenant': '{agent.tenant}'" in seen["args"] and f"'run_id': '{agent.run_id}'" in seen["args"]
        full = wait_until(lambda: (t := requests.get(f"{base}/api/task/info/{task_id}", timeout=10).json())
                          .get("state") == "SUCCESS" and t, 30, "Flower to see the call succeed", 0.2)
        assert secret not in json.dumps(full) and secret not in json.dumps(seen)
    finally:
        stack.stop()
