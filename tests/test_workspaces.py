"""Workspaces as a resource (contract section 11) against the real stack: create (empty, tar,
gzip, git clone), list, replace, delete, busy, quotas, tenants, idle expiry, the CLI, and uploads
far larger than the tool calls' body limit streaming through without being held in memory."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import pytest

from runwarden import devstack
from shared import keys
from shared.workspaces import member
from tests.archives import Operator, directory, file, gzip_of_zeros_member, link, streamed_zeros_tar, tar
from tests.conftest import Agent, StackInfo
from tests.waiting import ended, wait_until

BLOCKED = "until [ -e release ]; do sleep 0.02; done; echo released"
MiB = 1024 * 1024


@pytest.fixture
def operator(stack: StackInfo) -> Operator:
    return Operator(stack, f"t{uuid.uuid4().hex[:10]}")


def run_agent(stack: StackInfo, operator: Operator, run_id: str) -> Agent:
    return Agent(stack, operator.tenant, run_id, ["files:read", "files:write", "shell:exec"], ["**"])


def sample_tar(gz: bool = False) -> bytes:
    return tar(directory("src"), file("src/main.py", b"print('hi')\n"), file("bin/run.sh", b"#!/bin/sh\necho run\n", 0o755),
               link("latest", "src/main.py"), link("copy.py", "src/main.py", tarfile.LNKTYPE),
               file("deep/er/notes.txt", b"notes\n"), gz=gz)


def parse_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def test_an_empty_body_makes_an_empty_workspace(stack: StackInfo, operator: Operator) -> None:
    before = time.time()
    response = operator.put("r1", b"", content_type=None)
    assert response.status_code == 201, response.text
    assert response.json() == {"run_id": "r1", "files": 0, "bytes": 0}
    assert operator.path("r1").is_dir() and os.listdir(operator.path("r1")) == []
    listed = operator.listing()["r1"]
    assert (listed["bytes"], listed["files"], listed["node"]) == (0, 0, None)
    assert before - 1 <= parse_time(listed["last_used"]) <= time.time() + 1


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "gzip"])
def test_an_archive_is_extracted_for_the_run_to_use(stack: StackInfo, operator: Operator, gz: bool) -> None:
    response = operator.put("r1", sample_tar(gz), "application/gzip" if gz else "application/x-tar")
    assert response.status_code == 201, response.text
    # src, src/main.py, bin, bin/run.sh, latest, copy.py, deep, deep/er, deep/er/notes.txt
    assert response.json() == {"run_id": "r1", "files": 9, "bytes": 12 + 19 + 12 + 6}
    root = operator.path("r1")
    assert (root / "bin/run.sh").stat().st_mode & 0o777 == 0o755
    assert os.readlink(root / "latest") == "src/main.py"
    assert (root / "copy.py").stat().st_ino == (root / "src/main.py").stat().st_ino
    # Owned as a first call's workspace is: by the sandbox's user.
    made_by_a_call = Agent(stack, operator.tenant, "r-call", ["shell:exec"], ["**"])
    assert made_by_a_call.shell("true").status_code == 200
    owner = made_by_a_call.workspace.stat().st_uid
    assert {os.lstat(path).st_uid for path in [root, *root.rglob("*")]} == {owner}

    agent = run_agent(stack, operator, "r1")
    read = agent.call("read_file", {"path": "src/main.py"})
    assert read.status_code == 200 and read.json()["result"]["content"] == "print('hi')\n", read.text
    shell = agent.shell("cat latest && ./bin/run.sh && echo more >> deep/er/notes.txt && cat deep/er/notes.txt")
    result = shell.json()["result"]
    assert result["exit_code"] == 0 and result["stdout"] == "print('hi')\nrun\nnotes\nmore\n", result


def test_an_existing_workspace_is_kept_unless_replaced(stack: StackInfo, operator: Operator) -> None:
    assert operator.put("r1", tar(file("old.txt", b"old"))).status_code == 201
    again = operator.put("r1", tar(file("new.txt", b"new")))
    assert again.status_code == 409 and again.json()["code"] == "workspace_exists", again.text
    assert os.listdir(operator.path("r1")) == ["old.txt"]

    replaced = operator.put("r1", tar(file("new.txt", b"new!")), replace=True)
    assert replaced.status_code == 201 and replaced.json()["files"] == 1, replaced.text
    assert os.listdir(operator.path("r1")) == ["new.txt"]
    # The old tree, renamed aside, is removed once the answer is given; no staging directory is left.
    wait_until(lambda: os.listdir(operator.path("r1").parent) == ["r1"], 60, "the replaced tree to be removed")
    assert operator.listing()["r1"]["bytes"] == 4


def test_a_workspace_a_first_call_made_exists_too(stack: StackInfo, operator: Operator) -> None:
    agent = run_agent(stack, operator, "r1")
    assert agent.shell("head -c 5000 /dev/zero > data.bin").json()["result"]["exit_code"] == 0
    # Recorded when the call ended; measured by the workers' sweep a few seconds later.
    wait_until(lambda: operator.listing().get("r1", {}).get("bytes") == 5000, 60, "the workspace to be measured")
    assert operator.listing()["r1"]["files"] == 1
    conflict = operator.put("r1", b"", content_type=None)
    assert conflict.status_code == 409 and conflict.json()["code"] == "workspace_exists"


def test_delete(stack: StackInfo, operator: Operator) -> None:
    assert operator.put("r1", sample_tar()).status_code == 201
    deleted = operator.delete("r1")
    assert deleted.status_code == 204 and deleted.content == b"", deleted.text
    assert not os.path.lexists(operator.path("r1")) and "r1" not in operator.listing()
    wait_until(lambda: os.listdir(operator.path("r1").parent) == [], 60, "the deleted tree to be removed")
    again = operator.delete("r1")
    assert again.status_code == 404 and again.json()["code"] == "not_found", again.text


def test_a_busy_workspace_is_neither_deleted_nor_replaced(stack: StackInfo, operator: Operator) -> None:
    agent = run_agent(stack, operator, "r1")
    held = agent.shell(BLOCKED, wait=None, timeout_ms=60000)
    assert held.status_code == 202, held.text
    task_id = held.json()["task_id"]
    for response in (operator.delete("r1"), operator.put("r1", tar(file("x", b"x")), replace=True)):
        assert response.status_code == 409 and response.json()["code"] == "workspace_busy", response.text
    assert agent.workspace.is_dir()
    (agent.workspace / "release").write_bytes(b"go\n")  # on the host: the pool may be all held
    assert ended(agent, task_id)["status"] == "completed"
    wait_until(lambda: not stack.redis.scard(keys.run_active(agent.tenant, agent.run_id)), 30, "the call's slot")
    assert operator.delete("r1").status_code == 204
    assert not agent.workspace.exists()


def test_another_tenants_workspaces_are_invisible(stack: StackInfo, operator: Operator) -> None:
    assert operator.put("shared-name", tar(file("mine.txt", b"mine"))).status_code == 201
    other = Operator(stack, f"t{uuid.uuid4().hex[:10]}")
    assert "shared-name" not in other.listing()
    refused = other.delete("shared-name")
    assert refused.status_code == 404 and refused.json()["code"] == "not_found"
    assert other.put("shared-name", tar(file("theirs.txt", b"theirs"))).status_code == 201
    assert os.listdir(operator.path("shared-name")) == ["mine.txt"]
    assert os.listdir(other.path("shared-name")) == ["theirs.txt"]
    assert list(operator.listing()) == ["shared-name"] and operator.listing()["shared-name"]["bytes"] == 4


def test_the_tenants_workspace_quota_bounds_an_archive(stack: StackInfo, operator: Operator) -> None:
    done = subprocess.run([sys.executable, "-m", "runwarden.cli", "tenant", "set", operator.tenant,
                           "--workspace-bytes", "1000"], env=stack.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    over = operator.put("r1", tar(file("a.bin", bytes(600)), file("b.bin", bytes(600))))
    assert over.status_code == 422, over.text
    assert over.json()["code"] == "archive_rejected" and over.json()["member"] == "b.bin"
    assert not os.path.lexists(operator.path("r1"))
    within = operator.put("r1", tar(file("a.bin", bytes(600)), file("b.bin", bytes(400))))
    assert within.status_code == 201 and within.json()["bytes"] == 1000, within.text


def test_refusals(stack: StackInfo, operator: Operator) -> None:
    no_scope = Operator(stack, operator.tenant, scopes=["files:read", "files:write", "shell:exec"])
    for response in (no_scope.put("r1", b"", None), no_scope.delete("r1"),
                     no_scope.http.get(no_scope.url(), headers={"Authorization": f"Bearer {no_scope.token}"})):
        assert response.status_code == 403 and response.json()["code"] == "forbidden_scope", response.text
    unauthenticated = operator.http.put(operator.url("r1"), timeout=30)
    assert unauthenticated.status_code == 401
    for run_id in ("-starts-with-dash", "a" * 65, "dots..ok-but-%25"):
        bad = operator.put(run_id, b"", None)
        assert bad.status_code == 400 and bad.json()["code"] == "schema_invalid", (run_id, bad.text)
    assert operator.put("r1", b"text", "text/plain").status_code == 415
    assert operator.http.put(operator.url("r1") + "?replace=yes", headers={"Authorization": f"Bearer {operator.token}"},
                             timeout=30).status_code == 400
    for source in ({"git": {"url": "file:///etc"}}, {"git": {"url": "https://user:pw@example.com/r.git"}},
                   {"git": {"url": "https://example.com/r.git", "ref": "--upload-pack=evil"}},
                   {"git": {"url": "https://example.com/r.git", "ref": "a..b"}}, {"git": {"url": "ext::sh -c x"}},
                   {"git": {"url": "https://example.com/r.git"}, "extra": 1}):
        bad = operator.put("r1", json.dumps(source).encode(), "application/json")
        assert bad.status_code == 400 and bad.json()["code"] == "schema_invalid", (source, bad.text)
    assert not os.path.lexists(operator.path("r1")) and operator.listing() == {}


def test_idle_workspaces_expire_unless_busy(stack: StackInfo, operator: Operator) -> None:
    """A workspace whose last use is older than RUNWARDEN_WORKSPACE_IDLE_TTL (7 days here) is deleted
    by the workers' sweep; one with a call running is not, however old its last use."""
    settings_ttl = 7 * 86400
    for run_id in ("idle", "busy"):
        assert operator.put(run_id, tar(file("f", b"x"))).status_code == 201
    busy = run_agent(stack, operator, "busy")
    held = busy.shell(BLOCKED, wait=None, timeout_ms=60000)
    assert held.status_code == 202, held.text
    long_ago = time.time() - settings_ttl - 3600
    stack.redis.zadd(keys.WORKSPACES_BY_USE, {member(operator.tenant, run_id): long_ago for run_id in ("idle", "busy")})
    passes = int(stack.redis.hget(keys.WORKSPACE_SWEEPS, "passes") or 0)
    wait_until(lambda: "idle" not in operator.listing(), 60, "the idle workspace to expire")
    assert not os.path.lexists(operator.path("idle"))
    # Two more whole sweeps: each saw the busy one idle for over a week, with its call running.
    wait_until(lambda: int(stack.redis.hget(keys.WORKSPACE_SWEEPS, "passes") or 0) >= passes + 2, 60, "two sweeps")
    assert "busy" in operator.listing() and (operator.path("busy") / "f").exists()
    (busy.workspace / "release").write_bytes(b"go\n")
    assert ended(busy, held.json()["task_id"])["status"] == "completed"


def test_the_cli(stack: StackInfo, operator: Operator, tmp_path: Path) -> None:
    archive = tmp_path / "repo.tar.gz"
    archive.write_bytes(sample_tar(gz=True))
    env = {**stack.env, "RUNWARDEN_URL": stack.base_url}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runwarden.cli", "workspace", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    created = cli("create", "r1", "--tar", str(archive), "--tenant", operator.tenant)
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout) == {"run_id": "r1", "files": 9, "bytes": 49}
    assert cli("create", "r2", "--tenant", operator.tenant).returncode == 0
    exists = cli("create", "r1", "--tar", str(archive), "--tenant", operator.tenant)
    assert exists.returncode == 1 and exists.stderr.startswith("runwarden: workspace_exists:"), exists.stderr
    with_token = subprocess.run([sys.executable, "-m", "runwarden.cli", "workspace", "list"],
                                env={**env, "RUNWARDEN_TOKEN": operator.token}, capture_output=True, text=True,
                                timeout=120)
    assert with_token.returncode == 0, with_token.stderr
    assert [json.loads(line)["run_id"] for line in with_token.stdout.splitlines()] == ["r1", "r2"]
    assert cli("delete", "r2", "--tenant", operator.tenant).returncode == 0
    assert list(operator.listing()) == ["r1"]
    missing = cli("delete", "r2", "--tenant", operator.tenant)
    assert missing.returncode == 1 and "not_found" in missing.stderr
    assert cli("list").returncode == 2  # neither a token nor a tenant to mint one for


# ---- a git clone, by a worker, in a sandbox with the network ----

@pytest.fixture(scope="module")
def git_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the clone cannot be tested")
    base = tmp_path_factory.mktemp("git")
    repo = base / "demo.git"
    work = base / "work"
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(work)], check=True)
    (work / "a.txt").write_text("first\n")
    subprocess.run([*git, "-C", str(work), "add", "."], check=True)
    subprocess.run([*git, "-C", str(work), "commit", "-qm", "one"], check=True)
    subprocess.run([*git, "-C", str(work), "tag", "v1"], check=True)
    (work / "a.txt").write_text("second\n")
    (work / "link").symlink_to("a.txt")
    subprocess.run([*git, "-C", str(work), "add", "."], check=True)
    subprocess.run([*git, "-C", str(work), "commit", "-qm", "two"], check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(repo)], check=True)
    port = devstack.free_port()
    daemon = subprocess.Popen(["git", "daemon", "--export-all", f"--base-path={base}", f"--port={port}",
                               "--listen=127.0.0.1", "--reuseaddr", str(base)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _listening(port), 30, "git daemon")
        yield f"git://127.0.0.1:{port}"
    finally:
        daemon.terminate()
        daemon.wait(30)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_git_clone(stack: StackInfo, operator: Operator, git_server: str) -> None:
    cloned = operator.clone("r1", f"{git_server}/demo.git")
    assert cloned.status_code == 201, cloned.text
    root = operator.path("r1")
    assert (root / "a.txt").read_text() == "second\n" and os.readlink(root / "link") == "a.txt"
    assert (root / ".git").is_dir() and cloned.json()["files"] > 3
    assert operator.listing()["r1"]["bytes"] == cloned.json()["bytes"]
    tagged = operator.clone("r2", f"{git_server}/demo.git", ref="v1")
    assert tagged.status_code == 201, tagged.text
    assert (operator.path("r2") / "a.txt").read_text() == "first\n" and not (operator.path("r2") / "link").exists()
    agent = run_agent(stack, operator, "r2")
    log = agent.shell("git log --format=%s")
    assert log.json()["result"]["stdout"] == "one\n", log.text


def test_a_failed_or_oversized_clone_leaves_nothing(stack: StackInfo, operator: Operator, git_server: str) -> None:
    missing = operator.clone("r1", f"{git_server}/nothing-here.git")
    assert missing.status_code == 422 and missing.json()["code"] == "clone_failed", missing.text
    no_ref = operator.clone("r1", f"{git_server}/demo.git", ref="no-such-branch")
    assert no_ref.status_code == 422 and no_ref.json()["code"] == "clone_failed", no_ref.text
    subprocess.run([sys.executable, "-m", "runwarden.cli", "tenant", "set", operator.tenant, "--workspace-bytes",
                    "100"], env=stack.env, capture_output=True, timeout=60, check=True)
    too_big = operator.clone("r1", f"{git_server}/demo.git")
    assert too_big.status_code == 422 and too_big.json()["code"] == "archive_rejected", too_big.text
    assert not operator.path("r1").parent.exists() or os.listdir(operator.path("r1").parent) == []
    assert operator.listing() == {}


# ---- big uploads stream through: neither the API nor a worker holds them ----

def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_big_uploads_are_never_held_in_memory(stack: StackInfo, operator: Operator) -> None:
    """200 MiB of zeros gzipped (a small body, 200 MiB through a worker), then an uncompressed
    100 MiB tar streamed from a generator (chunked), far past the 2 MiB limit of tool calls: the
    API's and the pool processes' peak RSS (VmHWM, reset first) grow by far less than that."""
    if os.geteuid() != 0:
        pytest.skip("resetting another process's peak RSS (/proc/PID/clear_refs) needs root")
    api_master = next(process.pid for name, process in stack.stack.children if name == "api")
    workers = [process.pid for name, process in stack.stack.children if name.startswith("w")]
    watched = [*_children(api_master), *(child for pid in workers for child in _children(pid))]
    before = {}
    for pid in watched:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS := current RSS
        before[pid] = _status_kib(pid, "VmRSS")

    gz = operator.put("r-gz", gzip_of_zeros_member("zeros.bin", 200 * MiB), "application/gzip")
    assert gz.status_code == 201 and gz.json()["bytes"] == 200 * MiB, gz.text
    plain = operator.put("r-tar", streamed_zeros_tar("zeros.bin", 100 * MiB), "application/x-tar")
    assert plain.status_code == 201 and plain.json()["bytes"] == 100 * MiB, plain.text
    assert (operator.path("r-tar") / "zeros.bin").stat().st_size == 100 * MiB

    grown = {pid: (_status_kib(pid, "VmHWM") - before[pid]) // 1024 for pid in watched}
    assert max(grown.values()) < 64, f"peak RSS growth in MiB by process: {grown}"
    for run_id in ("r-gz", "r-tar"):
        assert operator.delete(run_id).status_code == 204
