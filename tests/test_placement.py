"""Node placement (contract section 14) with two real worker nodes on one machine, each with its own
workspaces root, as `runwarden dev --nodes 2` runs them."""
from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from shared import keys
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack

NODE_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("nodes"), nodes=2, RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_NODE_TIMEOUT=str(NODE_TIMEOUT_S))
    try:
        wait_for(lambda: info.redis.zcard(keys.NODES) == 2, "both nodes to heartbeat")
        yield info
    finally:
        info.stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def new_agent(info: StackInfo) -> Agent:
    return Agent(info, f"t{uuid.uuid4().hex[:8]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])


def node_of(info: StackInfo, agent: Agent) -> str:
    return info.redis.get(keys.placement(agent.tenant, agent.run_id)).decode()


def node_process(info: StackInfo, node: str) -> int:
    [process] = [p for name, p in info.stack.children if name == node]
    return process.pid


def test_a_runs_calls_all_go_to_its_node_and_see_the_same_files(nodes: StackInfo) -> None:
    agent = new_agent(nodes)
    agent.write("a.txt", b"from a patch\n")
    node = node_of(nodes, agent)
    result = agent.shell("cat a.txt; echo from a shell > b.txt").json()["result"]
    assert result["stdout"] == "from a patch\n"
    read = agent.call("read_file", {"path": "b.txt"}).json()["result"]
    assert read["content"] == "from a shell\n"
    on_disk = nodes.workspaces / node / agent.tenant / agent.run_id
    assert (on_disk / "b.txt").read_bytes() == b"from a shell\n"
    other = ({"node1", "node2"} - {node}).pop()
    assert not (nodes.workspaces / other / agent.tenant / agent.run_id).exists()
    task = nodes.redis.hget(keys.task(agent.shell("true").json()["task_id"]), "queue").decode()
    assert task == f"{keys.SHELL_QUEUE}@{node}"


def test_new_runs_spread_over_the_nodes(nodes: StackInfo) -> None:
    placed = []
    for _ in range(6):
        agent = new_agent(nodes)
        assert agent.call("read_file", {"path": "none"}).status_code == 404
        placed.append(node_of(nodes, agent))
    runs = {node: nodes.redis.scard(keys.node_runs(node)) for node in ("node1", "node2")}
    assert abs(runs["node1"] - runs["node2"]) <= 1, runs  # the fewest runs wins each new run
    assert set(placed) == {"node1", "node2"}


def test_a_frozen_node_turns_its_runs_calls_into_503_and_comes_back(nodes: StackInfo) -> None:
    agents: dict[str, Agent] = {}
    while len(agents) < 2:  # one run on each node
        agent = new_agent(nodes)
        assert agent.call("read_file", {"path": "none"}).status_code == 404
        agents.setdefault(node_of(nodes, agent), agent)
    frozen, alive = agents["node1"], agents["node2"]
    pid = node_process(nodes, "node1")
    os.killpg(pid, signal.SIGSTOP)  # its main process and pool: nothing restarts it, no heartbeat
    try:
        key = uuid.uuid4().hex
        wait_for(lambda: frozen.call("read_file", {"path": "none"}).status_code == 503, "the 503",
                 timeout_s=NODE_TIMEOUT_S * 20)
        refused = frozen.call("read_file", {"path": "none"}, key=key)
        assert refused.status_code == 503 and refused.json()["code"] == "workspace_unavailable"
        assert refused.headers["Content-Type"] == "application/problem+json" and refused.headers["Retry-After"]
        assert frozen.shell("echo x").status_code == 503
        assert alive.shell("echo still here").json()["result"]["stdout"] == "still here\n"
    finally:
        os.killpg(pid, signal.SIGCONT)
    wait_for(lambda: frozen.call("read_file", {"path": "none"}).status_code == 404, "the node to be back")
    # The 503 was not the call's outcome: the same key now runs it.
    again = frozen.call("read_file", {"path": "none"}, key=key)
    assert again.status_code == 404 and "Idempotent-Replayed" not in again.headers


def test_deleting_the_placement_frees_the_run(nodes: StackInfo) -> None:
    from shared.placement import Placement

    agent = new_agent(nodes)
    assert agent.call("read_file", {"path": "none"}).status_code == 404
    node = node_of(nodes, agent)
    Placement(nodes.redis).free(agent.tenant, agent.run_id)
    assert not nodes.redis.sismember(keys.node_runs(node), f"{agent.tenant}/{agent.run_id}")
    assert agent.call("read_file", {"path": "none"}).status_code == 404
    assert node_of(nodes, agent) in ("node1", "node2")


def test_a_workspace_made_by_put_places_its_run_and_delete_frees_it(nodes: StackInfo) -> None:
    agent = new_agent(nodes)
    admin = Agent(nodes, agent.tenant, "ops", ["workspaces:admin"], ["**"])
    url, auth = f"{nodes.base_url}/v1/workspaces/{agent.run_id}", {"Authorization": f"Bearer {admin.token}"}
    created = admin.http.put(url, headers=auth, timeout=60)
    assert created.status_code == 201, created.text
    node = node_of(nodes, agent)
    listed = admin.http.get(f"{nodes.base_url}/v1/workspaces", headers=auth, timeout=30).json()["workspaces"]
    assert [w["node"] for w in listed if w["run_id"] == agent.run_id] == [node]
    assert agent.shell("pwd; ls -A | wc -l").json()["result"]["stdout"] == "/workspace\n0\n"
    assert (nodes.workspaces / node / agent.tenant / agent.run_id).is_dir()
    assert admin.http.delete(url, headers=auth, timeout=60).status_code == 204
    assert nodes.redis.get(keys.placement(agent.tenant, agent.run_id)) is None
    assert not nodes.redis.sismember(keys.node_runs(node), f"{agent.tenant}/{agent.run_id}")
