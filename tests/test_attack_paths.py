"""Path attacks through the API: traversal, allowed_paths globs, symlinks (from the host and from
inside the sandbox), FIFOs and directories. Nothing outside the workspace is read or written."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import requests

from workers.patching import ZERO_SHA, git_blob_sha

PROBLEM_JSON = "application/problem+json"
SECRET_MARK = "rw-outside-secret"


def creation_diff(name: str, text: str = "pwned\n") -> str:
    return f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1 @@\n+{text}"


def assert_path_forbidden(response) -> None:  # type: ignore[no-untyped-def]
    assert response.status_code == 403, response.text
    assert response.headers["Content-Type"] == PROBLEM_JSON
    assert response.json()["code"] == "path_forbidden"


def outside_dir(agent) -> Path:  # type: ignore[no-untyped-def]
    """A directory next to the workspace (same tenant), with a secret file in it."""
    path = agent.workspace.parent / f"outside-{agent.run_id}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "secret.txt").write_text(f"{SECRET_MARK}\n")
    return path


def ensure_workspace(agent) -> None:  # type: ignore[no-untyped-def]
    """Let the worker create the workspace (owned by the sandbox's uid), as a real run would."""
    assert agent.shell("true", wait=30).status_code == 200


TRAVERSALS = ["../x", "a/../../x", "..", "./../x", "a/./../../..", "/etc/passwd", "//etc/passwd",
              "a\x00b", ".", "./", "a/..", "src/../../" + "x"]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_read_traversal_is_path_forbidden(agent, path: str) -> None:
    response = agent.call("read_file", {"path": path})
    assert_path_forbidden(response)
    assert "root:" not in response.text


@pytest.mark.parametrize("path", TRAVERSALS)
def test_patch_traversal_is_path_forbidden_and_writes_nothing(agent, path: str) -> None:
    response = agent.call("apply_file_patch", {"path": path, "diff": creation_diff("x"), "base_sha": ZERO_SHA})
    assert_path_forbidden(response)
    assert not (agent.workspace.parent / "x").exists()
    assert not (agent.stack.workspaces / "x").exists()


@pytest.mark.parametrize("tool", ["read_file", "apply_file_patch"])
def test_empty_path_is_schema_invalid(agent, tool: str) -> None:
    parameters = {"path": ""} if tool == "read_file" else {"path": "", "diff": creation_diff("x"),
                                                            "base_sha": ZERO_SHA}
    response = agent.call(tool, parameters)
    assert response.status_code == 400 and response.json()["code"] == "schema_invalid"
    assert "/parameters/path" in [error["pointer"] for error in response.json()["errors"]]


@pytest.mark.parametrize("cwd", ["..", "../other", "/", "/etc", "a\x00b"])
def test_shell_cwd_traversal_is_path_forbidden(agent, cwd: str) -> None:
    response = agent.shell("touch escaped-cwd", cwd=cwd, wait=30)
    assert_path_forbidden(response)
    assert not (agent.workspace.parent / "escaped-cwd").exists()


# --- allowed_paths globs ---------------------------------------------------------------------------

def _seed(agent, *relpaths: str) -> None:  # type: ignore[no-untyped-def]
    for relpath in relpaths:
        path = agent.workspace / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"content of {relpath}\n")


@pytest.mark.parametrize("patterns, granted, refused", [
    (["src/**"], ["src/a/b.txt", "src/top.txt"], ["secret.txt", "srcx/a.txt", "other/src/a.txt"]),
    (["src/*.py"], ["src/a.py"], ["src/x/a.py", "a.py", "src/a.pyc", "src/a.txt"]),
    (["docs"], ["docs/x/y", "docs/readme.md"], ["docsx/y", "readme.md", "src/docs/y"]),
    (["*.txt"], ["a.txt"], ["d/a.txt", "a.md"]),
    (["src/?.c"], ["src/a.c"], ["src/ab.c", "src//.c", "src/a/c"]),
    (["**/*.md"], ["a.md", "x/y/z.md"], ["a.txt", "x/y.txt"]),
])
def test_allowed_paths_globs(make_agent, patterns, granted, refused) -> None:
    caller = make_agent(scopes=["files:read", "files:write"], paths=patterns)
    _seed(caller, *granted, *[p for p in refused if "//" not in p])
    for relpath in granted:
        response = caller.call("read_file", {"path": relpath})
        assert response.status_code == 200, (relpath, response.text)
        assert response.json()["result"]["content"] == f"content of {relpath}\n"
    for relpath in refused:
        response = caller.call("read_file", {"path": relpath})
        assert_path_forbidden(response)
        assert "content of" not in response.text


def test_allowed_paths_also_bind_patches_and_cwd(make_agent) -> None:
    caller = make_agent(paths=["src/**"])
    response = caller.call("apply_file_patch", {"path": "outside.txt", "diff": creation_diff("outside.txt"),
                                                 "base_sha": ZERO_SHA})
    assert_path_forbidden(response)
    assert not (caller.workspace / "outside.txt").exists()
    ok = caller.call("apply_file_patch", {"path": "src/in.txt", "diff": creation_diff("src/in.txt"),
                                           "base_sha": ZERO_SHA})
    assert ok.status_code == 200, ok.text
    assert_path_forbidden(caller.shell("touch x", cwd="docs", wait=30))
    assert caller.shell("pwd", cwd="src", wait=30).json()["result"]["stdout"] == "/workspace/src\n"


# --- symlinks ---------------------------------------------------------------------------------------

def test_read_through_symlinked_dir_to_etc_is_forbidden(agent) -> None:
    ensure_workspace(agent)
    os.symlink("/etc", agent.workspace / "link")
    response = agent.call("read_file", {"path": "link/passwd"})
    assert_path_forbidden(response)
    assert "root:" not in response.text


def test_read_symlinked_file_is_forbidden(agent) -> None:
    ensure_workspace(agent)
    secret = outside_dir(agent) / "secret.txt"
    os.symlink("/etc/hostname", agent.workspace / "f")
    os.symlink(secret, agent.workspace / "g")
    os.symlink(f"../outside-{agent.run_id}/secret.txt", agent.workspace / "relative")
    for name in ("f", "g", "relative"):
        response = agent.call("read_file", {"path": name})
        assert_path_forbidden(response)
        assert SECRET_MARK not in response.text


def test_patch_through_symlinked_dir_writes_nothing_outside(agent) -> None:
    ensure_workspace(agent)
    outside = outside_dir(agent)
    before = sorted(p.name for p in outside.iterdir())
    os.symlink(outside, agent.workspace / "out")
    created = agent.call("apply_file_patch", {"path": "out/new.txt", "diff": creation_diff("new.txt"),
                                              "base_sha": ZERO_SHA})
    assert_path_forbidden(created)
    sha = git_blob_sha(f"{SECRET_MARK}\n".encode())
    changed = agent.call("apply_file_patch", {"path": "out/secret.txt", "base_sha": sha, "diff": (
        f"--- a/secret.txt\n+++ b/secret.txt\n@@ -1 +1 @@\n-{SECRET_MARK}\n+pwned\n")})
    assert_path_forbidden(changed)
    deep = agent.call("apply_file_patch", {"path": "out/deeper/new.txt", "diff": creation_diff("new.txt"),
                                           "base_sha": ZERO_SHA})
    assert_path_forbidden(deep)
    assert sorted(p.name for p in outside.iterdir()) == before
    assert (outside / "secret.txt").read_text() == f"{SECRET_MARK}\n"


def test_patch_of_symlinked_file_does_not_touch_its_target(agent) -> None:
    ensure_workspace(agent)
    outside = outside_dir(agent)
    os.symlink(outside / "secret.txt", agent.workspace / "ef")
    os.symlink(outside / "not-yet.txt", agent.workspace / "dangling")
    sha = git_blob_sha(f"{SECRET_MARK}\n".encode())
    changed = agent.call("apply_file_patch", {"path": "ef", "base_sha": sha, "diff": (
        f"--- a/ef\n+++ b/ef\n@@ -1 +1 @@\n-{SECRET_MARK}\n+pwned\n")})
    assert changed.status_code in (403, 412, 422) and changed.status_code != 200, changed.text
    deleted = agent.call("apply_file_patch", {"path": "ef", "base_sha": sha, "diff": (
        f"--- a/ef\n+++ /dev/null\n@@ -1 +0,0 @@\n-{SECRET_MARK}\n")})
    assert deleted.status_code != 200, deleted.text
    created = agent.call("apply_file_patch", {"path": "dangling", "diff": creation_diff("dangling"),
                                              "base_sha": ZERO_SHA})
    assert created.status_code != 200, created.text
    assert (outside / "secret.txt").read_text() == f"{SECRET_MARK}\n"
    assert not (outside / "not-yet.txt").exists()
    assert os.path.islink(agent.workspace / "ef")


def test_symlink_made_inside_the_sandbox_does_not_escape(agent) -> None:
    body = agent.shell("ln -s / escape && ln -s /etc/passwd pw && ln -s .. up && echo made", wait=30).json()
    assert body["result"]["stdout"] == "made\n", body
    for path in ("escape/etc/passwd", "escape/etc/hostname", "pw", f"up/{agent.run_id}/escape/etc/passwd"):
        response = agent.call("read_file", {"path": path})
        assert_path_forbidden(response)
        assert "root:" not in response.text
    write = agent.call("apply_file_patch", {"path": "escape/tmp/rw-escaped.txt",
                                            "diff": creation_diff("rw-escaped.txt"), "base_sha": ZERO_SHA})
    assert_path_forbidden(write)
    assert not Path("/tmp/rw-escaped.txt").exists()


def test_fifo_is_refused_without_hanging(agent) -> None:
    """A FIFO is refused, never opened: a worker that opened it would hang there, and the call
    would be a 202 after the API's wait instead of this 403, and the next call would find no worker."""
    body = agent.shell("mkfifo p && echo ok", wait=30).json()
    assert body["result"]["stdout"] == "ok\n", body
    assert_path_forbidden(agent.call("read_file", {"path": "p"}))
    assert_path_forbidden(agent.call("apply_file_patch", {"path": "p", "diff": creation_diff("p"),
                                                          "base_sha": ZERO_SHA}))
    agent.write("after.txt", b"served\n")  # both pool processes are still free to serve
    assert agent.call("read_file", {"path": "after.txt"}).json()["result"]["content"] == "served\n"


def test_reading_or_patching_a_directory_is_refused(agent) -> None:
    agent.write("dir/inside.txt", b"x\n")
    for path in ("dir", "dir/"):
        assert_path_forbidden(agent.call("read_file", {"path": path}))
    assert_path_forbidden(agent.call("apply_file_patch", {"path": "dir", "diff": creation_diff("dir"),
                                                          "base_sha": ZERO_SHA}))
    assert (agent.workspace / "dir" / "inside.txt").read_bytes() == b"x\n"


def test_deep_path_is_refused_cleanly(agent) -> None:
    ensure_workspace(agent)
    response = agent.call("read_file", {"path": "x/" * 2000 + "f"})
    assert response.status_code in (400, 403, 404), response.text
    assert response.headers["Content-Type"] == PROBLEM_JSON


def test_name_over_name_max_is_refused_cleanly(agent) -> None:
    """A name over NAME_MAX (255) is the caller's error: a prompt 4xx, and a finished record."""
    ensure_workspace(agent)
    (agent.workspace / "d").mkdir(exist_ok=True)
    for path in ("a" * 300, "d/" + "b" * 300, "d/" + "b" * 256):
        body = {"tool_name": "read_file", "call_id": str(uuid.uuid4()), "parameters": {"path": path}}
        response = requests.post(f"{agent.stack.base_url}/v1/tool-calls", data=json.dumps(body),
                                 headers=agent.headers(), timeout=60)  # a hang fails here
        assert_path_forbidden(response)  # answered by the call's own outcome, not the API's 202 after its wait
        record = agent.get(response.json()["task_id"])
        assert record.status_code == 404 or record.json()["status"] not in ("queued", "running"), record.text
    assert agent.call("read_file", {"path": "a" * 255}).json()["code"] == "file_not_found"  # NAME_MAX itself is a name
