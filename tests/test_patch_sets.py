"""apply_file_patches end to end (contract sections 2 and 13): several files as one change, all or
nothing, on the real stack; a worker SIGKILLed at every step of a set, held there by
workers/holds.py (never a race with a timer); overlapping sets; a property (hypothesis) that any
valid entries plus one invalid change nothing.
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import keys
from tests.conftest import ALL_SCOPES, Agent, StackInfo, reachable_workspaces, start_stack
from tests.test_faults import Hold, alive, task_field
from tests.waiting import wait_until
from workers.patching import ZERO_SHA, git_blob_sha

TOOL = "apply_file_patches"


def change(path: str, old: bytes, new: bytes) -> dict[str, str]:
    """An entry replacing a one-line file's line."""
    diff = f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-{old.decode()}+{new.decode()}"
    return {"path": path, "diff": diff, "base_sha": git_blob_sha(old)}


def create(path: str, new: bytes) -> dict[str, str]:
    return {"path": path, "diff": f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+{new.decode()}",
            "base_sha": ZERO_SHA}


def delete(path: str, old: bytes) -> dict[str, str]:
    return {"path": path, "diff": f"--- a/{path}\n+++ /dev/null\n@@ -1 +0,0 @@\n-{old.decode()}",
            "base_sha": git_blob_sha(old)}


def files_of(agent: Agent) -> dict[str, bytes]:
    """Every file of the workspace (hidden ones too: staged leftovers would show), by path."""
    root = agent.workspace
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dirs_of(agent: Agent) -> set[str]:
    return {str(p.relative_to(agent.workspace)) for p in agent.workspace.rglob("*") if p.is_dir()}


def seed(agent: Agent, files: dict[str, bytes]) -> None:
    agent.workspace.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        (agent.workspace / path).parent.mkdir(parents=True, exist_ok=True)
        (agent.workspace / path).write_bytes(data)


def patches(agent: Agent, entries: list[dict[str, str]], *, dry_run: bool | None = None, key: str | None = None,
            call_id: str | None = None) -> requests.Response:
    parameters: dict[str, Any] = {"patches": entries}
    if dry_run is not None:
        parameters["dry_run"] = dry_run
    return agent.call(TOOL, parameters, key=key, call_id=call_id)


# --- applying ------------------------------------------------------------------------------------

def test_a_set_changes_creates_and_deletes_as_one(agent: Agent) -> None:
    seed(agent, {"a.txt": b"a1\n", "c.txt": b"c1\n"})
    entries = [change("a.txt", b"a1\n", b"a2\n"), create("new/dir/b.txt", b"b1\n"), delete("c.txt", b"c1\n")]
    response = patches(agent, entries)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "completed" and body["tool_name"] == TOOL
    assert body["result"] == {"dry_run": False, "files": [
        {"path": "a.txt", "base_sha": git_blob_sha(b"a1\n"), "new_sha": git_blob_sha(b"a2\n"),
         "created": False, "deleted": False},
        {"path": "new/dir/b.txt", "base_sha": ZERO_SHA, "new_sha": git_blob_sha(b"b1\n"),
         "created": True, "deleted": False},
        {"path": "c.txt", "base_sha": git_blob_sha(b"c1\n"), "new_sha": ZERO_SHA, "created": False,
         "deleted": True},
    ]}
    assert files_of(agent) == {"a.txt": b"a2\n", "new/dir/b.txt": b"b1\n"}  # and nothing staged is left
    assert agent.get(body["task_id"]).json() == body
    read = agent.call("read_file", {"path": "new/dir/b.txt"}).json()["result"]
    assert read["sha"] == git_blob_sha(b"b1\n")


def test_paths_are_normalized_and_modes_kept(agent: Agent) -> None:
    seed(agent, {"bin/run.sh": b"echo 1\n"})
    (agent.workspace / "bin/run.sh").chmod(0o755)
    entry = {**change("bin/run.sh", b"echo 1\n", b"echo 2\n"), "path": "./bin//run.sh"}
    response = patches(agent, [entry])
    assert response.status_code == 200, response.text
    assert response.json()["result"]["files"][0]["path"] == "bin/run.sh"
    assert (agent.workspace / "bin/run.sh").stat().st_mode & 0o777 == 0o755


# --- refusals: each names its entry, and nothing changes ---------------------------------------

@pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_stale_entry_anywhere_changes_nothing(agent: Agent, position: int) -> None:
    seed(agent, {"x.txt": b"x1\n", "y.txt": b"y1\n", "z.txt": b"z1\n"})
    entries = [change("x.txt", b"x1\n", b"x2\n"), change("y.txt", b"y1\n", b"y2\n"), create("made/w.txt", b"w\n")]
    stale_path = ["x.txt", "y.txt", "z.txt"][position]
    entries[position] = {**change(stale_path, b"old\n", b"new\n")}
    before, before_dirs = files_of(agent), dirs_of(agent)
    response = patches(agent, entries)
    assert response.status_code == 412, response.text
    body = response.json()
    assert body["code"] == "base_sha_mismatch" and body["failed_index"] == position
    assert body["path"] == stale_path and body["current_sha"] == git_blob_sha(before[stale_path])
    assert files_of(agent) == before and dirs_of(agent) == before_dirs  # no file, no directory, no staged leftover
    result = agent.get(body["task_id"]).json()["result"]
    assert (result["code"], result["failed_index"], result["path"]) == ("base_sha_mismatch", position, stale_path)


@pytest.mark.parametrize("problem, status, code", [
    ("does_not_apply", 422, "patch_does_not_apply"),
    ("missing", 404, "file_not_found"),
    ("symlink", 403, "path_forbidden"),
    ("exists", 412, "base_sha_mismatch"),
])
def test_each_kind_of_failing_entry_is_named(agent: Agent, problem: str, status: int, code: str) -> None:
    seed(agent, {"ok.txt": b"ok\n", "there.txt": b"here\n", "real/f.txt": b"f\n"})
    os.symlink("real", agent.workspace / "link")
    bad = {
        "does_not_apply": {**change("ok2.txt", b"zz\n", b"yy\n"), "path": "there.txt",
                           "base_sha": git_blob_sha(b"here\n")},
        "missing": change("nowhere/gone.txt", b"g\n", b"h\n"),
        "symlink": change("link/f.txt", b"f\n", b"g\n"),
        "exists": create("there.txt", b"again\n"),
    }[problem]
    before = files_of(agent)
    response = patches(agent, [change("ok.txt", b"ok\n", b"OK\n"), bad])
    assert response.status_code == status, response.text
    assert response.json()["code"] == code and response.json()["failed_index"] == 1
    assert files_of(agent) == before


@pytest.mark.parametrize("paths, status, code, index", [
    (["a.txt", "../etc/passwd"], 403, "path_forbidden", 1),
    (["/etc/passwd"], 403, "path_forbidden", 0),
    (["a.txt", "sub/./b.txt", "sub//b.txt"], 400, "schema_invalid", 2),
    (["a.txt", "a.txt"], 400, "schema_invalid", 1),
    (["a.txt", "secret/key.txt"], 403, "path_forbidden", 1),
])
def test_traversal_duplicates_and_ungranted_paths_are_refused(make_agent, paths: list[str], status: int, code: str,
                                                             index: int) -> None:
    agent = make_agent(paths=["a.txt", "sub/**"])
    entries = [{"path": path, "diff": "--- /dev/null\n+++ b/x\n@@ -0,0 +1 @@\n+x\n", "base_sha": ZERO_SHA}
               for path in paths]
    response = patches(agent, entries)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and body["failed_index"] == index, body
    assert "Traceback" not in response.text
    if code == "schema_invalid":
        assert body["errors"][0]["pointer"] == f"/parameters/patches/{index}/path"
    assert not agent.workspace.exists() or files_of(agent) == {}


@pytest.mark.parametrize("count", [0, 65])
def test_a_set_holds_one_to_sixty_four_entries(agent: Agent, count: int) -> None:
    entries = [create(f"f{i}.txt", b"x\n") for i in range(count)]
    response = patches(agent, entries)
    assert response.status_code == 400 and response.json()["code"] == "schema_invalid", response.text


def test_sixty_four_entries_apply(agent: Agent) -> None:
    response = patches(agent, [create(f"many/f{i:02d}.txt", b"%d\n" % i) for i in range(64)])
    assert response.status_code == 200, response.text
    assert files_of(agent) == {f"many/f{i:02d}.txt": b"%d\n" % i for i in range(64)}


def test_a_set_larger_than_what_is_held_in_memory_applies(agent: Agent) -> None:
    """Three 24 MB files: past 64 MiB of new contents the rest is worked out again when staged,
    rather than held from the check on (a set may name 64 files of up to 32 MiB)."""
    big = {f"big{i}.txt": b"".join(b"row %08d\n" % n for n in range(1_840_000)) for i in range(3)}
    seed(agent, big)
    entries = [{"path": name, "base_sha": git_blob_sha(data),
                "diff": f"--- a/{name}\n+++ b/{name}\n@@ -1 +1 @@\n-row 00000000\n+first of {name}\n"}
               for name, data in big.items()]
    response = patches(agent, entries)
    assert response.status_code == 200, response.text
    for name, data in big.items():
        expected = data.replace(b"row 00000000\n", f"first of {name}\n".encode(), 1)
        assert (agent.workspace / name).read_bytes() == expected
    assert [f["new_sha"] for f in response.json()["result"]["files"]] == [
        git_blob_sha(data.replace(b"row 00000000\n", f"first of {name}\n".encode(), 1)) for name, data in big.items()]
    assert sorted(files_of(agent)) == sorted(big)


# --- dry run and replay ----------------------------------------------------------------------------

def test_a_dry_run_checks_everything_and_writes_nothing(agent: Agent) -> None:
    seed(agent, {"d.txt": b"d1\n", "e.txt": b"e1\n"})
    entries = [change("d.txt", b"d1\n", b"d2\n"), create("new/f.txt", b"f\n"), delete("e.txt", b"e1\n")]
    before, before_dirs = files_of(agent), dirs_of(agent)
    response = patches(agent, entries, dry_run=True)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert result["dry_run"] is True
    assert [f["new_sha"] for f in result["files"]] == [git_blob_sha(b"d2\n"), git_blob_sha(b"f\n"), ZERO_SHA]
    assert files_of(agent) == before and dirs_of(agent) == before_dirs
    failing = patches(agent, [entries[0], change("e.txt", b"other\n", b"x\n")], dry_run=True)
    assert failing.status_code == 412 and failing.json()["failed_index"] == 1
    assert files_of(agent) == before
    applied = patches(agent, entries)  # what the dry run said is what happens
    assert applied.status_code == 200 and applied.json()["result"]["files"] == result["files"]


def test_a_replay_answers_the_same_bytes_and_writes_nothing(agent: Agent) -> None:
    seed(agent, {"r.txt": b"r1\n", "s.txt": b"s1\n"})
    entries = [change("r.txt", b"r1\n", b"r2\n"), change("s.txt", b"s1\n", b"s2\n")]
    key, call_id = f"set-{uuid.uuid4()}", str(uuid.uuid4())
    first = patches(agent, entries, key=key, call_id=call_id)
    assert first.status_code == 200, first.text
    (agent.workspace / "r.txt").write_bytes(b"r1\n")  # as if someone put the old file back
    replay = patches(agent, entries, key=key, call_id=call_id)
    assert replay.status_code == 200 and replay.content == first.content
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert files_of(agent) == {"r.txt": b"r1\n", "s.txt": b"s2\n"}  # nothing ran again
    failed_key = f"set-{uuid.uuid4()}"
    failed = patches(agent, entries, key=failed_key)
    assert failed.status_code == 412
    again = patches(agent, entries, key=failed_key, call_id=failed.json()["call_id"])
    assert again.status_code == 412 and again.content == failed.content
    assert again.headers["Idempotent-Replayed"] == "true"


# --- concurrency -----------------------------------------------------------------------------------

@pytest.mark.parametrize("round_", range(4))
def test_overlapping_sets_sent_at_once_never_mix(agent: Agent, round_: int) -> None:
    """Two sets over the same three files, listed in opposite orders (a deadlock if locks were taken
    in the order sent), from the same base: one applies, the other is refused (412); never a mix."""
    names = ["p.txt", "q.txt", "r.txt"]
    seed(agent, {name: b"0\n" for name in names})
    sets = {tag: [change(name, b"0\n", tag.encode() + b"\n") for name in order]
            for tag, order in (("one", names), ("two", names[::-1]))}
    barrier = threading.Barrier(2)

    def send(tag: str) -> requests.Response:
        barrier.wait()
        return patches(agent, sets[tag])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = dict(zip(sets, pool.map(send, sets)))
    statuses = sorted(answer.status_code for answer in answers.values())
    assert statuses == [200, 412], {tag: a.text for tag, a in answers.items()}
    [winner] = [tag for tag, answer in answers.items() if answer.status_code == 200]
    assert files_of(agent) == {name: winner.encode() + b"\n" for name in names}
    [loser] = [answer for answer in answers.values() if answer.status_code == 412]
    assert loser.json()["code"] == "base_sha_mismatch" and loser.json()["failed_index"] == 0


def test_a_set_and_single_patches_share_the_locks(agent: Agent) -> None:
    """Single patches on the set's files, sent with it: each applies before or after it, whole."""
    seed(agent, {"m.txt": b"0\n", "n.txt": b"0\n"})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        the_set = pool.submit(patches, agent, [change("m.txt", b"0\n", b"set\n"), change("n.txt", b"0\n", b"set\n")])
        singles = [pool.submit(agent.call, "apply_file_patch", change(name, b"0\n", b"single\n"))
                   for name in ("n.txt", "m.txt")]
        answers = [the_set.result(), *(s.result() for s in singles)]
    final = files_of(agent)
    if answers[0].status_code == 200:
        assert [a.status_code for a in answers[1:]] == [412, 412] and final == {"m.txt": b"set\n", "n.txt": b"set\n"}
    else:  # a single patch came first: the set changed nothing
        assert answers[0].status_code == 412
        assert all(final[name] == (b"single\n" if a.status_code == 200 else b"0\n")
                   for name, a in zip(("n.txt", "m.txt"), answers[1:]))


# --- property: any valid entries plus one invalid change nothing ------------------------------

FILES = {f"p{i}.txt": b"line %d\n" % i for i in range(6)}
INVALID = ["stale", "does_not_apply", "missing", "exists"]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(valid=st.lists(st.sampled_from(sorted(FILES)), unique=True, max_size=5),
       invalid=st.sampled_from(INVALID), position=st.integers(min_value=0, max_value=5))
def test_any_valid_entries_plus_one_invalid_change_nothing(stack: StackInfo, valid: list[str], invalid: str,
                                                           position: int) -> None:
    agent = Agent(stack, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])
    seed(agent, FILES)
    entries = [change(name, FILES[name], b"changed\n") for name in valid]
    unused = sorted(set(FILES) - set(valid))[0]
    bad = {"stale": change(unused, b"not this\n", b"x\n"),
           "does_not_apply": {**change(unused, b"not this\n", b"x\n"), "base_sha": git_blob_sha(FILES[unused])},
           "missing": change("absent/q.txt", b"q\n", b"r\n"),
           "exists": create(unused, b"again\n")}[invalid]
    position = min(position, len(entries))
    entries.insert(position, bad)
    before, before_dirs = files_of(agent), dirs_of(agent)
    response = patches(agent, entries)
    assert response.status_code in (404, 412, 422), response.text
    assert response.json()["failed_index"] == position
    assert files_of(agent) == before and dirs_of(agent) == before_dirs


# --- a worker killed at every step ----------------------------------------------------------------

@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Two workers with one pool child each, and holds armed through RUNWARDEN_TEST_HOLD_DIR."""
    tmp = tmp_path_factory.mktemp("sets")
    (tmp / "holds").mkdir()
    workspaces = reachable_workspaces()
    info = start_stack(tmp, workers=2, concurrency=1, RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_TEST_HOLD_DIR=str(tmp / "holds"))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


def held_agent(info: StackInfo) -> Agent:
    return Agent(info, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])


OLD = {"a.txt": b"a-old\n", "b.txt": b"b-old\n", "c.txt": b"c-old\n"}
ENTRIES = [change("a.txt", b"a-old\n", b"a-new\n"), delete("b.txt", b"b-old\n"),
           change("c.txt", b"c-old\n", b"c-new\n"), create("made/d.txt", b"d-new\n")]
NEW = {"a.txt": b"a-new\n", "c.txt": b"c-new\n", "made/d.txt": b"d-new\n"}
# Where a worker is held, what the workspace shows then (its files, and how many are staged):
# entries 0, 2 and 3 are staged, entry 1 is a delete; step i is held before it is done.
MOMENTS = {
    "patch_set_staged": ({"a.txt": b"a-old\n", "b.txt": b"b-old\n", "c.txt": b"c-old\n"}, 3),
    "patch_set_rename_0": ({"a.txt": b"a-old\n", "b.txt": b"b-old\n", "c.txt": b"c-old\n"}, 3),
    "patch_set_rename_1": ({"a.txt": b"a-new\n", "b.txt": b"b-old\n", "c.txt": b"c-old\n"}, 2),
    "patch_set_rename_2": ({"a.txt": b"a-new\n", "c.txt": b"c-old\n"}, 2),
    "patch_set_rename_3": ({"a.txt": b"a-new\n", "c.txt": b"c-new\n"}, 1),
    "before_finish": (NEW, 0),
}


@dataclass
class HeldSet:
    agent: Agent
    key: str
    call_id: str
    task_id: str
    victim: int  # the pool child held


def start_held_set(info: StackInfo, moment: str) -> HeldSet:
    """The four entries sent as a set, its worker held at `moment`."""
    agent = held_agent(info)
    seed(agent, OLD)
    key, call_id = f"set-{uuid.uuid4()}", str(uuid.uuid4())
    task_id = keys.task_id_for(agent.tenant, key)
    hold = Hold(info, task_id, moment)
    threading.Thread(target=lambda: patches(agent, ENTRIES, key=key, call_id=call_id), daemon=True).start()
    return HeldSet(agent, key, call_id, task_id, hold.wait())


def visible_and_staged(agent: Agent) -> tuple[dict[str, bytes], int]:
    files = files_of(agent)
    return {k: v for k, v in files.items() if ".rw-" not in k}, sum(".rw-" in k for k in files)


def finished(agent: Agent, task_id: str) -> dict[str, Any]:
    def terminal() -> dict[str, Any] | None:
        body = agent.get(task_id).json()
        return body if body["status"] not in ("queued", "running") else None
    return wait_until(terminal, 90, f"the set {task_id} to end", 0.1)


def worker_logs(info: StackInfo) -> str:
    return "".join(log.read_text(errors="replace") for log in info.logs.glob("worker*.log"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_a_worker_killed_at_any_step_leaves_all_new_after_redelivery(held: StackInfo, moment: str) -> None:
    """SIGKILL the pool child held at each step: staged but not committed, before each rename, after
    the last. Then the disk is all old or partly renamed; after the redelivery it is all new, the
    call completed once, no lock is held and nothing staged is left; a retry replays."""
    run = start_held_set(held, moment)
    assert visible_and_staged(run.agent) == MOMENTS[moment]
    os.kill(run.victim, signal.SIGKILL)
    wait_until(lambda: not alive(run.victim), 30, "the pool child to die")
    assert task_field(held, run.task_id, "status") == "running"
    body = finished(run.agent, run.task_id)
    assert body["status"] == "completed", body
    assert [f["new_sha"] for f in body["result"]["files"]] == [
        git_blob_sha(b"a-new\n"), ZERO_SHA, git_blob_sha(b"c-new\n"), git_blob_sha(b"d-new\n")]
    assert files_of(run.agent) == NEW
    assert task_field(held, run.task_id, "attempts") == "2"
    assert not held.redis.exists(keys.patch_intent(run.task_id))
    assert list(held.redis.scan_iter(match=f"rw:lock:{run.agent.tenant}:*")) == []  # every lock released
    retry = patches(run.agent, ENTRIES, key=run.key, call_id=run.call_id)
    assert retry.status_code == 200 and retry.headers["Idempotent-Replayed"] == "true", retry.text
    assert retry.json() == body and files_of(run.agent) == NEW


@pytest.mark.timeout(180)
def test_a_waiting_worker_finishes_a_set_whose_worker_died(held: StackInfo) -> None:
    """The set's worker dies between renames and its redelivery is held as it starts: a single patch
    on one of its files (against the set's new content) waits for the lock, finds the set's lease
    expired, finishes the set itself, then applies. The redelivery then finds the call completed
    and changes nothing."""
    run = start_held_set(held, "patch_set_rename_2")
    again = Hold(held, run.task_id, "patch_set_start")  # the redelivery waits there
    os.kill(run.victim, signal.SIGKILL)
    again.wait()
    assert visible_and_staged(run.agent) == MOMENTS["patch_set_rename_2"]  # half done
    single = run.agent.call("apply_file_patch", change("c.txt", b"c-new\n", b"c-after\n"))
    assert single.status_code == 200, single.text
    assert f"finishing patch set {run.task_id} for its worker" in worker_logs(held)  # the waiter did it
    body = finished(run.agent, run.task_id)
    assert body["status"] == "completed" and body["result"]["files"][2]["new_sha"] == git_blob_sha(b"c-new\n")
    assert files_of(run.agent) == {**NEW, "c.txt": b"c-after\n"}
    again.armed.with_name(f"{again.armed.name}.go").touch()  # let the redelivery go on
    wait_until(lambda: f"[{run.task_id}] succeeded" in worker_logs(held), 60, "the redelivery to end")
    assert files_of(run.agent) == {**NEW, "c.txt": b"c-after\n"}
    assert run.agent.get(run.task_id).json() == body


@pytest.mark.timeout(180)
def test_sets_that_list_shared_files_in_opposite_orders_do_not_deadlock(held: StackInfo) -> None:
    """Set one is held once it has its first lock; set two, listing the same files the other way
    round, is sent meanwhile and held where it first has to wait for a lock. Locks taken in the
    order sent would deadlock from here (one holds p and waits for q, the other holds r and q and
    waits for p); in sorted order the second waits for p, the first finishes, and the second is
    refused by its stale base, with nothing mixed."""
    agent = held_agent(held)
    names = ["p.txt", "q.txt", "r.txt"]
    seed(agent, {name: b"0\n" for name in names})
    first_key, second_key = f"set-{uuid.uuid4()}", f"set-{uuid.uuid4()}"
    first_hold = Hold(held, keys.task_id_for(agent.tenant, first_key), "patch_set_locked_0")
    second_hold = Hold(held, keys.task_id_for(agent.tenant, second_key), "patch_set_waits")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(patches, agent, [change(n, b"0\n", b"one\n") for n in names], key=first_key)
        first_hold.wait()
        second = pool.submit(patches, agent, [change(n, b"0\n", b"two\n") for n in reversed(names)], key=second_key)
        second_hold.wait()
        for hold in (first_hold, second_hold):
            hold.armed.with_name(f"{hold.armed.name}.go").touch()
        answers = [first.result(timeout=90), second.result(timeout=90)]
    assert [a.status_code for a in answers] == [200, 412], [a.text for a in answers]
    assert answers[1].json()["failed_index"] == 0  # r.txt, listed first, is "one" now
    assert files_of(agent) == {name: b"one\n" for name in names}


def test_the_model_reads_a_set_a_dry_run_and_a_failed_entry(agent: Agent) -> None:
    from tests.test_model_native import post, results, texts, tool_use
    seed(agent, {"u.txt": b"u1\n", "v.txt": b"v1\n"})
    entries = [change("u.txt", b"u1\n", b"u2\n"), change("v.txt", b"v1\n", b"v2\n")]
    stale = [entries[0], change("v.txt", b"v0\n", b"v2\n")]
    # One turn's blocks run concurrently: these two write nothing, so their order does not matter.
    dry, failed = results(post(agent, "/v1/tool-use", [tool_use(TOOL, {"patches": entries, "dry_run": True}),
                                                       tool_use(TOOL, {"patches": stale})]))
    [applied] = results(post(agent, "/v1/tool-use", tool_use(TOOL, {"patches": entries})))
    [dry_text], [failed_text], [applied_text] = texts(dry), texts(failed), texts(applied)
    assert dry["is_error"] is False and dry_text.startswith("Dry run") and "nothing was written" in dry_text
    assert failed["is_error"] is True and "Entry 1 (v.txt)" in failed_text and "no file was changed" in failed_text
    assert git_blob_sha(b"v1\n") in failed_text  # the current sha to write the patch against
    assert applied["is_error"] is False
    assert git_blob_sha(b"u2\n") in applied_text and git_blob_sha(b"v2\n") in applied_text
    assert files_of(agent) == {"u.txt": b"u2\n", "v.txt": b"v2\n"}
    forbidden = results(post(agent, "/v1/tool-use", tool_use(TOOL, {"patches": [entries[0], {**entries[1],
                                                                                          "path": "../v.txt"}]})))
    assert forbidden[0]["is_error"] is True and "Entry 1" in texts(forbidden[0])[0]


@pytest.mark.timeout(180)
def test_a_set_whose_lease_lapsed_while_it_paused_still_finishes(held: StackInfo) -> None:
    """Its worker is held between renames until the set's lease (3 s here) has lapsed, and no one
    needs its files: let go, it takes its lease back and finishes the set itself."""
    run = start_held_set(held, "patch_set_rename_2")
    wait_until(lambda: not held.redis.exists(keys.lease(run.task_id)), 60, "the set's lease to lapse")
    Path(held.env["RUNWARDEN_TEST_HOLD_DIR"], f"{run.task_id}.patch_set_rename_2.go").touch()
    body = finished(run.agent, run.task_id)
    assert body["status"] == "completed" and files_of(run.agent) == NEW
    assert task_field(held, run.task_id, "attempts") == "1"  # the same delivery finished it


@pytest.mark.timeout(180)
def test_a_paused_worker_whose_set_was_finished_for_it_touches_nothing_after(held: StackInfo) -> None:
    """The set's worker is held (alive) before it deletes b.txt until its lease lapses; a patch
    creating b.txt anew waits for b.txt's lock, finishes the set for it (deleting the old b.txt),
    then creates its own. Let go, the set's worker must not carry on with its delete."""
    run = start_held_set(held, "patch_set_rename_1")
    wait_until(lambda: not held.redis.exists(keys.lease(run.task_id)), 60, "the set's lease to lapse")
    again = run.agent.call("apply_file_patch", create("b.txt", b"b-again\n"))
    assert again.status_code == 200, again.text
    assert finished(run.agent, run.task_id)["status"] == "completed"
    Path(held.env["RUNWARDEN_TEST_HOLD_DIR"], f"{run.task_id}.patch_set_rename_1.go").touch()
    wait_until(lambda: f"[{run.task_id}] succeeded" in worker_logs(held), 60, "the held worker to end the task")
    assert files_of(run.agent) == {**NEW, "b.txt": b"b-again\n"}
