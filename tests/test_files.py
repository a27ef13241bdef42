"""read_file and apply_file_patch end to end: HTTP → token → idempotency → Celery → worker → disk."""
from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import subprocess
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis
import requests

from shared import keys
from shared.errors import BaseShaMismatch
from shared.records import Records, Started
from workers import workspace
from workers.files import PatchApplier, Prepared
from workers.patching import ZERO_SHA, git_blob_sha
from tests.waiting import ended, wait_until


def git_diff(tmp_path: Path, old: bytes | None, new: bytes | None, name: str = "f.txt") -> str:
    """The diff `git diff --no-index` writes, so the applier is checked against git itself."""
    a, b = tmp_path / "a" / name, tmp_path / "b" / name
    for path, data in ((a, old), (b, new)):
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            path.write_bytes(data)
    left = f"a/{name}" if old is not None else "/dev/null"
    right = f"b/{name}" if new is not None else "/dev/null"
    out = subprocess.run(["git", "diff", "--no-index", "--no-color", left, right], cwd=tmp_path,
                         capture_output=True).stdout
    return out.decode("utf-8")


AWKWARD = {
    "crlf": (b"one\r\ntwo\r\nthree\r\n", b"one\r\n2\r\nthree\r\n"),
    "mixed_endings": (b"a\r\nb\nc\rd\r\n", b"a\r\nB\nc\rd\r\n"),
    "no_final_newline": (b"alpha\nbeta", b"alpha\nbeta\ngamma"),
    "add_final_newline": (b"alpha\nbeta", b"alpha\nbeta\n"),
    "tabs_trailing_spaces": (b"\tindent  \nx \t\n", b"\tindent  \n\t\tx \t \n"),
    "nbsp_emoji": ("a\u00a0b\n😀 smile\n".encode(), "a\u00a0b\n😀 grin 🎉\n".encode()),
    "indonesian_cjk": ("Selamat pagi, dunia\n你好，世界\n".encode(), "Selamat malam, dunia\n你好，世界！\n".encode()),
    "one_empty_line": (b"\n", b"\n\n"),
    "backslashes_json": (b'{"a": "x\\\\y\\n"}\n', b'{"a": "x\\\\y\\t\\u00e9"}\n'),
}


@pytest.mark.parametrize("name", sorted(AWKWARD))
def test_patch_is_byte_exact(agent, tmp_path: Path, name: str) -> None:
    old, new = AWKWARD[name]
    created = agent.call("apply_file_patch", {"path": f"awk/{name}.txt", "base_sha": ZERO_SHA,
                                             "diff": git_diff(tmp_path / "c", None, old)})
    assert created.status_code == 200, created.text
    assert created.json()["result"]["new_sha"] == git_blob_sha(old)
    response = agent.call("apply_file_patch", {"path": f"awk/{name}.txt", "base_sha": git_blob_sha(old),
                                              "diff": git_diff(tmp_path / "p", old, new)})
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert result == {"path": f"awk/{name}.txt", "base_sha": git_blob_sha(old), "new_sha": git_blob_sha(new),
                      "created": False, "deleted": False}
    assert (agent.workspace / "awk" / f"{name}.txt").read_bytes() == new
    read = agent.call("read_file", {"path": f"awk/{name}.txt"}).json()["result"]
    assert read["sha"] == git_blob_sha(new) and read["size"] == len(new)
    assert read["content"].encode() == new and read["encoding"] == "utf-8"


def test_read_file_invalid_utf8_is_base64(agent) -> None:
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "bin.dat").write_bytes(b"\xff\xfe\x00abc")
    body = agent.call("read_file", {"path": "bin.dat"}).json()
    assert body["result"]["encoding"] == "base64"
    assert base64.b64decode(body["result"]["content"]) == b"\xff\xfe\x00abc"
    assert body["result"]["sha"] == git_blob_sha(b"\xff\xfe\x00abc")


def test_response_carries_ids_as_sent(agent) -> None:
    call_id = str(uuid.uuid4()).upper()  # a UUID in upper case is still a UUID, echoed as sent
    response = agent.call("read_file", {"path": "missing.txt"}, call_id=call_id)
    assert response.status_code == 404
    assert response.headers["Content-Type"] == "application/problem+json"
    body = response.json()
    assert body["code"] == "file_not_found" and body["call_id"] == call_id
    assert body["tool_name"] == "read_file" and body["task_id"]


def test_delete_and_recreate(agent, tmp_path: Path) -> None:
    sha = agent.write("gone.txt", b"bye\n")
    response = agent.call("apply_file_patch", {"path": "gone.txt", "base_sha": sha,
                                              "diff": git_diff(tmp_path, b"bye\n", None, "gone.txt")})
    assert response.status_code == 200, response.text
    assert response.json()["result"]["deleted"] is True
    assert response.json()["result"]["new_sha"] == ZERO_SHA
    assert not (agent.workspace / "gone.txt").exists()
    assert agent.call("read_file", {"path": "gone.txt"}).status_code == 404


def test_base_sha_mismatch_is_412_with_current_sha(agent, tmp_path: Path) -> None:
    sha = agent.write("v.txt", b"v1\n")
    stale = git_blob_sha(b"v0\n")
    response = agent.call("apply_file_patch", {"path": "v.txt", "base_sha": stale,
                                              "diff": git_diff(tmp_path, b"v0\n", b"v2\n", "v.txt")})
    assert response.status_code == 412
    assert response.json()["code"] == "base_sha_mismatch" and response.json()["current_sha"] == sha
    assert (agent.workspace / "v.txt").read_bytes() == b"v1\n"


def test_create_over_existing_file_is_412(agent, tmp_path: Path) -> None:
    sha = agent.write("exists.txt", b"here\n")
    response = agent.call("apply_file_patch", {"path": "exists.txt", "base_sha": ZERO_SHA,
                                              "diff": git_diff(tmp_path, None, b"new\n", "exists.txt")})
    assert response.status_code == 412 and response.json()["current_sha"] == sha


def test_patch_missing_file_is_404(agent, tmp_path: Path) -> None:
    response = agent.call("apply_file_patch", {"path": "nope.txt", "base_sha": git_blob_sha(b"x\n"),
                                              "diff": git_diff(tmp_path, b"x\n", b"y\n", "nope.txt")})
    assert response.status_code == 404 and response.json()["code"] == "file_not_found"


@pytest.mark.parametrize("diff", [
    "not a diff at all\n",
    "--- a/f.txt\n+++ b/f.txt\n",  # no hunk
    "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n-x\n+y\n",  # counts do not match lines
    "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-different\n+y\n",  # context does not match
    "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-x \n+y\n",  # trailing space differs: no whitespace fixing
    "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-x\r\n+y\n",  # CRLF vs LF: no line-ending fixing
    "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-x\n+y\n--- a/g.txt\n+++ b/g.txt\n@@ -1 +1 @@\n-x\n+y\n",
])
def test_patch_that_does_not_apply_is_422_and_changes_nothing(agent, diff: str) -> None:
    sha = agent.write("f.txt", b"x\n")
    response = agent.call("apply_file_patch", {"path": "f.txt", "base_sha": sha, "diff": diff})
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "patch_does_not_apply"
    assert (agent.workspace / "f.txt").read_bytes() == b"x\n"


def test_mode_is_kept(agent, tmp_path: Path) -> None:
    sha = agent.write("run.sh", b"#!/bin/sh\necho a\n")
    (agent.workspace / "run.sh").chmod(0o755)
    response = agent.call("apply_file_patch", {"path": "run.sh", "base_sha": sha, "diff": git_diff(
        tmp_path, b"#!/bin/sh\necho a\n", b"#!/bin/sh\necho b\n", "run.sh")})
    assert response.status_code == 200
    assert (agent.workspace / "run.sh").stat().st_mode & 0o777 == 0o755


# --- idempotency -------------------------------------------------------------------------------

@pytest.mark.parametrize("first_form, second_form", [("{}", "{}"), ("{}", '"{}"'), ('"{}"', "{}")],
                         ids=["plain", "quoted_retry", "quoted_first"])
def test_replay_is_byte_identical_and_runs_nothing(agent, tmp_path: Path, first_form: str, second_form: str) -> None:
    """The same key, bare or in the IETF draft's double quotes (not part of the key), replays."""
    agent.write("r.txt", b"1\n")
    params = {"path": "r.txt", "base_sha": git_blob_sha(b"1\n"), "diff": git_diff(tmp_path, b"1\n", b"2\n", "r.txt")}
    call_id, key = str(uuid.uuid4()), f"key-{uuid.uuid4()}"
    first = agent.call("apply_file_patch", params, key=first_form.format(key), call_id=call_id)
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    (agent.workspace / "r.txt").write_bytes(b"changed behind our back\n")
    second = agent.call("apply_file_patch", params, key=second_form.format(key), call_id=call_id)
    assert second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert (agent.workspace / "r.txt").read_bytes() == b"changed behind our back\n"


def test_replay_keeps_the_calls_own_error_outcome(agent) -> None:
    key, call_id = uuid.uuid4().hex, str(uuid.uuid4())
    first = agent.call("read_file", {"path": "later.txt"}, key=key, call_id=call_id)
    assert first.status_code == 404
    agent.write("later.txt", b"now it exists\n")
    again = agent.call("read_file", {"path": "later.txt"}, key=key, call_id=call_id)
    assert again.status_code == 404 and again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("change", ["tool", "parameters", "call_id", "run"])
def test_same_key_different_request_is_422(agent, make_agent, change: str) -> None:
    agent.write("a.txt", b"a\n")
    key, call_id = uuid.uuid4().hex, str(uuid.uuid4())
    assert agent.call("read_file", {"path": "a.txt"}, key=key, call_id=call_id).status_code == 200
    caller, tool, params = agent, "read_file", {"path": "a.txt"}
    if change == "tool":
        tool, params = "execute_shell_command", {"command": "true"}
    elif change == "parameters":
        params = {"path": "b.txt"}
    elif change == "call_id":
        call_id = str(uuid.uuid4())
    else:
        caller = make_agent(tenant=agent.tenant)  # same tenant, another run
    response = caller.call(tool, params, key=key, call_id=call_id)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "idempotency_key_reused"


def test_keys_are_scoped_per_tenant(agent, make_agent) -> None:
    other = make_agent()
    key = uuid.uuid4().hex
    agent.write("x.txt", b"mine\n")
    other.write("x.txt", b"theirs\n")
    mine = agent.call("read_file", {"path": "x.txt"}, key=key)
    theirs = other.call("read_file", {"path": "x.txt"}, key=key)
    assert mine.json()["result"]["content"] == "mine\n"
    assert theirs.json()["result"]["content"] == "theirs\n"
    assert mine.json()["task_id"] != theirs.json()["task_id"]


def test_concurrent_identical_requests_execute_once(agent, tmp_path: Path) -> None:
    """50 identical patches at once: one claims the key and runs, held by the file's lock (taken
    here) until the 49 others have answered 409 with the running call's task id."""
    agent.write("c.txt", b"0\n")
    params = {"path": "c.txt", "base_sha": git_blob_sha(b"0\n"), "diff": git_diff(tmp_path, b"0\n", b"1\n", "c.txt")}
    key, call_id = uuid.uuid4().hex, str(uuid.uuid4())
    body = json.dumps({"tool_name": "apply_file_patch", "call_id": call_id, "parameters": params})
    url = f"{agent.stack.base_url}/v1/tool-calls"
    lock = keys.file_lock(agent.tenant, agent.run_id, "c.txt")
    agent.stack.redis.set(lock, "another-task", px=60_000)

    def post(_: int) -> requests.Response:
        return requests.post(url, data=body, headers=agent.headers(key), timeout=90)

    try:
        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            futures = [pool.submit(post, n) for n in range(50)]
            wait_until(lambda: sum(f.done() for f in futures) == 49, 25, "the 49 requests that met the first running")
            answered = [f for f in futures if f.done()]
            agent.stack.redis.delete(lock)
            [first] = [f for f in futures if f not in answered]
            conflicts, fresh = [f.result() for f in answered], first.result()
    finally:
        agent.stack.redis.delete(lock)
    assert fresh.status_code == 200 and "Idempotent-Replayed" not in fresh.headers, fresh.text
    for conflict in conflicts:
        assert conflict.status_code == 409, conflict.text
        assert conflict.json()["code"] == "idempotency_key_in_use" and int(conflict.headers["Retry-After"]) > 0
        assert conflict.json()["task_id"] == fresh.json()["task_id"] and "stream_url" not in conflict.json()
    attempts = agent.stack.redis.hget(keys.task(fresh.json()["task_id"]), "attempts")
    assert attempts == b"1"
    assert (agent.workspace / "c.txt").read_bytes() == b"1\n"


def test_concurrent_identical_shell_requests_run_once(agent) -> None:
    """20 identical shell calls at once: one 202; the 19 others, sent while it runs (it waits for
    a file), are 409 with its task id and stream_url. The command ran once; a retry replays the 202."""
    key, call_id = uuid.uuid4().hex, str(uuid.uuid4())
    body = json.dumps({"tool_name": "execute_shell_command", "call_id": call_id,
                       "parameters": {"command": "echo run >> runs.txt; while [ ! -e go ]; do sleep 0.05; done"}})
    url = f"{agent.stack.base_url}/v1/tool-calls"

    def post(_: int) -> requests.Response:
        return requests.post(url, data=body, headers=agent.headers(key), timeout=90)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(post, range(20)))
    [accepted] = [r for r in responses if r.status_code == 202]
    task_id, stream_url = accepted.json()["task_id"], accepted.json()["stream_url"]
    conflicts = [r for r in responses if r is not accepted]
    assert len(conflicts) == 19
    for conflict in conflicts:
        assert conflict.status_code == 409, conflict.text
        assert conflict.headers["Content-Type"] == "application/problem+json" and int(conflict.headers["Retry-After"]) > 0
        problem = conflict.json()
        assert problem["code"] == "idempotency_key_in_use"
        assert problem["task_id"] == task_id and problem["stream_url"] == stream_url
    assert agent.get(task_id).json()["status"] in ("queued", "running")  # still held: every 409 met it unfinished
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "go").touch()
    assert ended(agent, task_id)["status"] == "completed"
    assert (agent.workspace / "runs.txt").read_bytes() == b"run\n"
    assert agent.stack.redis.hget(keys.task(task_id), "attempts") == b"1"
    replay = post(0)
    assert replay.status_code == 202 and replay.content == accepted.content
    assert replay.headers["Idempotent-Replayed"] == "true"


def test_two_patches_on_one_base_sha_only_one_applies(agent, tmp_path: Path) -> None:
    sha = agent.write("race.txt", b"base\n")
    diffs = [git_diff(tmp_path / str(i), b"base\n", f"version {i}\n".encode(), "race.txt") for i in range(2)]

    def patch(i: int) -> requests.Response:
        return agent.call("apply_file_patch", {"path": "race.txt", "base_sha": sha, "diff": diffs[i]})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(patch, range(2)))
    assert sorted(r.status_code for r in responses) == [200, 412]
    winner = next(r for r in responses if r.status_code == 200).json()["result"]["new_sha"]
    loser = next(r for r in responses if r.status_code == 412).json()
    assert loser["current_sha"] == winner
    assert git_blob_sha((agent.workspace / "race.txt").read_bytes()) == winner
    # the finish script freed the file's lock after the 200 and after the 412
    assert not agent.stack.redis.exists(keys.file_lock(agent.tenant, agent.run_id, "race.txt"))


def test_patch_waits_for_a_lock_another_task_holds(agent, tmp_path: Path) -> None:
    """The start script finds the lock taken, so the patch waits for it, then applies."""
    sha = agent.write("held.txt", b"old\n")
    lock = keys.file_lock(agent.tenant, agent.run_id, "held.txt")
    agent.stack.redis.set(lock, "another-task", px=30_000)
    params = {"path": "held.txt", "base_sha": sha, "diff": git_diff(tmp_path, b"old\n", b"new\n", "held.txt")}
    key = uuid.uuid4().hex
    task_id = keys.task_id_for(agent.tenant, key)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(agent.call, "apply_file_patch", params, key=key)
        # running: its worker took the call; the start found the lock taken, so it waits for it
        wait_until(lambda: agent.stack.redis.hget(keys.task(task_id), "status") == b"running", 30,
                   "the patch to be running")
        assert not pending.done()
        assert (agent.workspace / "held.txt").read_bytes() == b"old\n"
        assert agent.stack.redis.get(lock) == b"another-task"
        agent.stack.redis.delete(lock)
        response = pending.result(timeout=30)
    assert response.status_code == 200, response.text
    assert (agent.workspace / "held.txt").read_bytes() == b"new\n"
    assert not agent.stack.redis.exists(lock)


def test_patch_intent_is_set_even_if_its_connection_dies_unread(stack) -> None:
    """The intent SET is sent early and its reply read late; if the connection is lost meanwhile
    (here: killed while Redis holds writes), it is sent again and the connection is not reused."""
    applier = PatchApplier(redis.Redis.from_url(stack.redis_url), intent_ttl_s=60, workspaces=stack.workspaces)
    key = f"rw:test:intent:{uuid.uuid4()}"
    connection_id = applier.client.client_id()  # the pool's one connection, which _setting reuses
    stack.redis.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
    try:
        with applier._setting(key, "the intent") as confirmed:
            assert stack.redis.client_kill_filter(_id=connection_id) == 1
            stack.redis.execute_command("CLIENT", "UNPAUSE")
            confirmed()
    finally:
        stack.redis.execute_command("CLIENT", "UNPAUSE")
    assert stack.redis.get(key) == b"the intent"
    assert 0 < stack.redis.ttl(key) <= 60
    assert applier.client.client_id() != connection_id  # the pool still serves, on a new connection


def test_patch_intent_reply_never_reaches_the_next_command(stack) -> None:
    """A write that fails between sending the intent and reading its reply leaves that reply
    unread: the connection is dropped, never handed to the next command with a stale reply."""
    applier = PatchApplier(redis.Redis.from_url(stack.redis_url), intent_ttl_s=60, workspaces=stack.workspaces)
    other = f"rw:test:other:{uuid.uuid4()}"
    stack.redis.set(other, "its own value")
    with pytest.raises(OSError), applier._setting(f"rw:test:intent:{uuid.uuid4()}", "x"):
        raise OSError("the disk refused")
    assert applier.client.get(other) == b"its own value"


def test_replaced_file_is_let_go_only_after_the_answer(stack, tmp_path) -> None:
    """The file a patch replaces stays open (unlinked) until `after_answer`, so freeing its blocks
    happens after the call has answered, not inside the rename; a refused patch lets go too."""
    applier = PatchApplier(redis.Redis.from_url(stack.redis_url), intent_ttl_s=60, workspaces=tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f.txt").write_bytes(b"one\n")
    old_inode = (ws / "f.txt").stat().st_ino
    diff = "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-one\n+two\n"
    task_id = str(uuid.uuid4())
    outcome = applier.apply(ws, "t", "r", task_id, "f.txt", diff, git_blob_sha(b"one\n"), held=b"")
    assert (ws / "f.txt").read_bytes() == b"two\n" and outcome["new_sha"] == git_blob_sha(b"two\n")
    [held] = applier.replaced
    assert os.fstat(held).st_ino == old_inode and os.fstat(held).st_nlink == 0  # open, no longer named
    applier.after_answer()
    assert applier.replaced == [] and applier.spare.fd is not None
    with pytest.raises(OSError):
        os.fstat(held)
    with pytest.raises(BaseShaMismatch):
        applier.apply(ws, "t", "r", str(uuid.uuid4()), "f.txt", diff, git_blob_sha(b"one\n"), held=b"")
    assert len(applier.replaced) == 1
    applier.after_answer()
    assert applier.replaced == []
    os.close(applier.spare.fd)
    stack.redis.delete(keys.patch_intent(task_id))


ONE_TWO = "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-one\n+two\n"


class PreparedPatch:
    """A run workspace holding f.txt = "one\\n", a ready spare, and a queued file call to start."""

    def __init__(self, stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
        client = redis.Redis.from_url(stack.redis_url)
        self.redis = client
        self.applier = PatchApplier(client, intent_ttl_s=60, workspaces=tmp_path)
        self.records = Records(client, ttl_s=60, retention_s=60, lease_s=60)
        self.ws = tmp_path / "ws"
        self.ws.mkdir()
        (self.ws / "f.txt").write_bytes(b"one\n")
        self.applier.spare.restock()
        self.task_id = str(uuid.uuid4())
        self.lock = f"rw:test:lock:{self.task_id}"
        client.hset(keys.task(self.task_id), mapping={"status": "queued"})

    def start(self, prepared: Prepared, meanwhile=None) -> Started:  # type: ignore[no-untyped-def]
        return self.records.start(self.task_id, "test-worker", reentrant=True, lock=self.lock,
                                  proposed=prepared.intent, meanwhile=meanwhile or prepared.write)

    def intent(self) -> bytes | None:
        return self.redis.get(keys.patch_intent(self.task_id))

    def close(self) -> None:
        self.applier.after_answer()
        os.close(self.applier.spare.fd)
        self.redis.delete(keys.task(self.task_id), keys.patch_intent(self.task_id), self.lock,
                          keys.lease(self.task_id))


@pytest.fixture
def prepared_patch(stack, tmp_path: Path):  # type: ignore[no-untyped-def]
    setup = PreparedPatch(stack, tmp_path)
    yield setup
    setup.close()


def test_prepared_patch_is_written_during_the_start_and_committed_under_the_lock(prepared_patch) -> None:
    """The start is sent before the new bytes are written (nameless: nothing in the workspace yet)
    and its reply read after; it takes the lock and records the intent; the commit renames them in."""
    t = prepared_patch
    with ExitStack() as stack:
        prepared = t.applier.prepare(stack, t.ws, "f.txt", ONE_TWO, git_blob_sha(b"one\n"))
        assert prepared is not None and prepared.outcome["new_sha"] == git_blob_sha(b"two\n")
        seen: list[object] = []

        def meanwhile() -> None:
            deadline = time.monotonic() + 30
            while t.intent() is None and time.monotonic() < deadline:  # the start already ran in Redis
                time.sleep(0.001)
            prepared.write()
            seen.append((t.intent(), sorted(p.name for p in t.ws.iterdir())))

        started = t.start(prepared, meanwhile)
        assert started.status == "running" and started.intent == b""  # the lock, and no earlier intent
        assert prepared.written and seen == [(prepared.intent, ["f.txt"])]
        assert t.intent() == prepared.intent and t.redis.get(t.lock) == t.task_id.encode()
        assert (t.ws / "f.txt").read_bytes() == b"one\n"
        assert prepared.commit()
    assert (t.ws / "f.txt").read_bytes() == b"two\n" and sorted(p.name for p in t.ws.iterdir()) == ["f.txt"]


@pytest.mark.parametrize("meanwhile", ["replaced", "deleted", "symlink"])
def test_prepared_patch_is_not_committed_once_the_file_changed(prepared_patch, meanwhile: str) -> None:
    """Another patch (a new inode), a delete, or a symlink swapped in after the file was read: the
    prepared bytes never land, and the locked path decides again."""
    t = prepared_patch
    with ExitStack() as stack:
        prepared = t.applier.prepare(stack, t.ws, "f.txt", ONE_TWO, git_blob_sha(b"one\n"))
        assert prepared is not None
        if meanwhile == "replaced":  # as a patch that held the lock just before this one would
            dir_fd = stack.enter_context(workspace.parent_dir(t.ws, "f.txt"))[0]
            workspace.replace(dir_fd, "f.txt", b"one\n", workspace.read(dir_fd, "f.txt"))
        elif meanwhile == "deleted":
            (t.ws / "f.txt").unlink()
        else:
            (t.ws / "f.txt").unlink()
            (t.ws / "f.txt").symlink_to("/etc/passwd")
        assert t.start(prepared).intent == b""
        assert not prepared.commit()
    if meanwhile == "symlink":
        assert (t.ws / "f.txt").is_symlink()
    else:
        assert not (t.ws / "f.txt").exists() or (t.ws / "f.txt").read_bytes() == b"one\n"
    assert [p.name for p in t.ws.iterdir()] == (["f.txt"] if meanwhile != "deleted" else [])


def test_prepared_creation_is_not_committed_over_a_file_made_meanwhile(prepared_patch) -> None:
    t = prepared_patch
    diff = "--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+made\n"
    with ExitStack() as stack:
        prepared = t.applier.prepare(stack, t.ws, "new.txt", diff, ZERO_SHA)
        assert prepared is not None and prepared.outcome["created"]
        (t.ws / "new.txt").write_bytes(b"someone else's\n")
        t.start(prepared)
        assert not prepared.commit()
    assert (t.ws / "new.txt").read_bytes() == b"someone else's\n"


def test_start_records_a_proposed_intent_only_with_the_lock_and_never_over_an_earlier_one(prepared_patch) -> None:
    t = prepared_patch
    with ExitStack() as stack:
        prepared = t.applier.prepare(stack, t.ws, "f.txt", ONE_TWO, git_blob_sha(b"one\n"))
        assert prepared is not None
        t.redis.set(t.lock, "another-task", px=30_000)
        assert t.start(prepared).intent is None  # the lock is another task's: nothing recorded
        assert t.intent() is None
        t.redis.delete(t.lock)
        t.redis.set(keys.patch_intent(t.task_id), b"an earlier delivery's")
        assert t.start(prepared).intent == b"an earlier delivery's"  # running again (reentrant)
        assert t.intent() == b"an earlier delivery's"


def test_overlapped_start_survives_an_unloaded_script_and_a_dropped_connection(prepared_patch) -> None:
    """NOSCRIPT (Redis restarted or flushed) and a connection killed with the reply unread: the start
    runs again the usual way, `meanwhile` runs once, and the reply of the lost one is never read
    by the connection's next user."""
    t = prepared_patch
    with ExitStack() as stack:
        prepared = t.applier.prepare(stack, t.ws, "f.txt", ONE_TWO, git_blob_sha(b"one\n"))
        assert prepared is not None
        t.redis.script_flush()
        calls: list[int] = []
        assert t.start(prepared, lambda: calls.append(1)).status == "running" and calls == [1]

        connection_id = t.records.client.client_id()  # the pool's one idle connection, which start reuses
        t.redis.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
        try:
            def kill() -> None:
                calls.append(2)
                assert t.redis.client_kill_filter(_id=connection_id) == 1
                t.redis.execute_command("CLIENT", "UNPAUSE")
            started = t.start(prepared, kill)
        finally:
            t.redis.execute_command("CLIENT", "UNPAUSE")
        assert started.status == "running" and calls == [1, 2]
        assert t.records.client.hget(keys.task(t.task_id), "status") == b"running"


@pytest.mark.parametrize("case", ["deletes", "base_mismatch", "missing_directory", "no_spare", "does_not_apply"])
def test_prepare_leaves_anything_but_a_plain_patch_to_the_locked_path(prepared_patch, case: str) -> None:
    t = prepared_patch
    path, diff, base = "f.txt", ONE_TWO, git_blob_sha(b"one\n")
    if case == "deletes":
        diff = "--- a/f.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-one\n"
    elif case == "base_mismatch":
        base = git_blob_sha(b"other\n")
    elif case == "missing_directory":
        path, diff, base = "sub/new.txt", "--- /dev/null\n+++ b/sub/new.txt\n@@ -0,0 +1 @@\n+x\n", ZERO_SHA
    elif case == "no_spare":
        dir_fd = os.open(t.ws, os.O_RDONLY)
        spare = t.applier.spare.take_nameless(dir_fd)
        os.close(dir_fd)
        assert spare is not None
        os.close(spare)
    else:
        diff = ONE_TWO.replace("-one", "-uno")
    with ExitStack() as stack:
        assert t.applier.prepare(stack, t.ws, path, diff, base) is None
    assert sorted(p.name for p in t.ws.iterdir()) == ["f.txt"]
    if case == "no_spare":
        t.applier.spare.restock()


def test_get_returns_the_record(agent) -> None:
    agent.write("g.txt", b"g\n")
    posted = agent.call("read_file", {"path": "g.txt"}).json()
    got = agent.get(posted["task_id"])
    assert got.status_code == 200
    assert got.json() == posted
