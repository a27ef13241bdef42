"""Escape attempts from inside the sandbox, through execute_shell_command.

The sandbox must show its run's workspace and the system's programs, and nothing else of the host:
no home directories, no secrets, no worker environment, no other workspace, no network, no host
processes, no capabilities; and its limits must protect the worker and its neighbours.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import pytest

from shared.settings import Settings
from workers.cgroups import Cgroups
from tests.sandboxes import host_processes_with
from tests.streams import Received, connect
from tests.waiting import cancel, ended, run, wait_until


@pytest.fixture
def agent(make_agent, sandbox_path):  # type: ignore[no-untyped-def]
    """Every attack, on both paths: a sandbox spawned for the call, and one prepared ahead of it."""
    return sandbox_path.wrap(make_agent())


def host_processes_of(stack, name: str) -> list[int]:  # type: ignore[no-untyped-def]
    """Pids of host processes whose parent is one of the stack's `name` processes (pool children)."""
    parents = {p.pid for child_name, p in stack.stack.children if name in " ".join(map(str, p.args))}
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^PPid:\s+(\d+)$", status, re.M)
        if match and int(match.group(1)) in parents:
            found.append(int(pid))
    return sorted(found)


def test_no_home_root_or_shadow(agent) -> None:
    result = run(agent, "ls -A /root; echo rc=$?; ls -A /home; echo rc=$?; cat /etc/shadow; echo rc=$?; "
                        "cat /root/.bash_history /root/.ssh/id_rsa 2>&1 | head -c 200; echo")
    lines = result["stdout"].splitlines()
    assert lines[:3] == ["rc=2", "rc=2", "rc=1"], result
    assert "root:" not in result["stdout"]


def test_host_tls_keys_and_unlisted_etc_files_are_absent(agent) -> None:
    """/etc is a built copy of a few files: not /etc/ssl/private (0700 host root, which a sandbox
    started by a root bwrap would own from inside), nor the host's hostname, shadow or machine-id."""
    result = run(agent, "for f in /etc/ssl/private /etc/shadow /etc/hostname /etc/machine-id /etc/ssh; do "
                        "test -e $f && echo FOUND $f; done; test -r /etc/ld.so.cache && echo ld-ok; echo end")
    assert result["stdout"] == "ld-ok\nend\n", result


def test_passwd_is_the_sandboxs_own(agent) -> None:
    result = run(agent, "cat /etc/passwd; echo ---; id -un")
    passwd, user = result["stdout"].split("---\n")
    assert [line.split(":")[0] for line in passwd.splitlines()] == ["sandbox", "nobody"], result
    assert user == "sandbox\n", result


def test_worker_environment_and_secrets_are_invisible(agent) -> None:
    stack = agent.stack
    redis = urlsplit(stack.redis_url)
    result = run(agent, "cat /proc/1/environ | tr '\\0' '\\n'; echo ---; env; echo ---; "
                        "for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ; done 2>/dev/null")
    text = result["stdout"]
    assert "PATH=" in text  # the output is real, not an empty failure
    assert stack.secret not in text
    assert "RUNWARDEN_" not in text
    assert str(redis.port) not in text
    if redis.password:
        assert redis.password not in text
    assert "redis://" not in text


def test_other_tenants_workspace_is_invisible(agent, make_agent) -> None:
    other = make_agent()
    marker = f"rw-other-tenant-{uuid.uuid4().hex}"
    other.write(f"{marker}.txt", b"theirs\n")
    assert (other.workspace / f"{marker}.txt").exists()
    host_root = agent.stack.workspaces
    result = run(agent, f"ls -a /workspace/..; echo ---; find / -name '{marker}*' 2>/dev/null; echo ---; "
                        f"ls {host_root} 2>&1; ls /proc/1/root/{other.tenant} 2>&1; "
                        f"cat /workspace/../{other.tenant}/{other.run_id}/*.txt 2>&1; "
                        f"cat ../{other.tenant}/{other.run_id}/*.txt 2>&1; echo end")
    listing, found, rest = result["stdout"].split("---\n")
    assert rest.endswith("end\n"), result
    assert found == "", found
    assert "theirs" not in rest
    assert other.tenant not in listing.split() and agent.tenant not in listing.split()
    assert (other.workspace / f"{marker}.txt").read_bytes() == b"theirs\n"


def test_cannot_write_outside_workspace_and_tmp(agent) -> None:
    marker = f"rw-escape-{uuid.uuid4().hex[:8]}"
    result = run(agent, f"for d in /usr /usr/bin /usr/local /etc/passwd /etc/ssl /proc/sys/kernel; do "
                        f"  if touch $d/{marker} 2>/dev/null; then echo WROTE $d; fi; done; "
                        f"echo x > /etc/passwd 2>/dev/null && echo WROTE passwd; "
                        f"echo 1 > /proc/sys/kernel/hostname 2>/dev/null && echo WROTE proc; "
                        f"touch /tmp/{marker} /run/{marker} /workspace/{marker} && echo ok")
    assert "WROTE" not in result["stdout"], result
    assert result["stdout"].endswith("ok\n")
    assert (agent.workspace / marker).exists()
    for directory in ("/usr", "/usr/bin", "/usr/local", "/etc", "/etc/ssl", "/tmp", "/"):
        assert not (Path(directory) / marker).exists(), directory
    # Nothing persists between calls: the next one gets a fresh, empty /tmp and /run (a directory of
    # the sandbox's own root tmpfs).
    again = run(agent, f"ls /{marker} /etc/{marker} /tmp/{marker} /run/{marker} 2>&1; echo ---; "
                       "ls -A /tmp /run; echo end")
    missing, listing = again["stdout"].split("---\n")
    assert missing.count("No such file") == 4, again
    assert listing == "/run:\n\n/tmp:\nend\n", again


def _ports(stack) -> list[int]:  # type: ignore[no-untyped-def]
    return [urlsplit(stack.redis_url).port, urlsplit(stack.base_url).port]


def test_no_network_reaches_redis_or_the_api(agent) -> None:
    checks = "; ".join(f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo OPEN {port} || echo closed {port}"
                       for port in _ports(agent.stack))
    result = run(agent, f"{checks}; ls /sys/class/net 2>/dev/null; cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    assert "OPEN" not in result["stdout"], result
    assert result["stdout"].count("closed") == 2
    interfaces = {line.strip() for line in result["stdout"].split("\n")[2:] if line.strip()}
    assert interfaces <= {"lo"}, interfaces


def test_shell_network_scope_does_share_the_network(make_agent) -> None:
    """The positive control of the test above: the same probe connects when the token grants the network."""
    caller = make_agent(scopes=["shell:exec", "shell:network"])
    port = urlsplit(caller.stack.base_url).port
    result = run(caller, f"(exec 3<>/dev/tcp/127.0.0.1/{port}) && echo OPEN || echo closed")
    assert result["stdout"] == "OPEN\n", result


def test_host_processes_are_invisible(agent) -> None:
    result = run(agent, "ls /proc | grep -c '^[0-9]'; echo ---; "
                        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done 2>/dev/null; "
                        "ps -eo comm 2>/dev/null")
    count, _, rest = result["stdout"].partition("---")
    assert int(count) <= 10, result["stdout"]
    for name in ("celery", "gunicorn", "redis-server", "pytest"):
        assert name not in rest, name


def test_no_capabilities_and_not_root(agent) -> None:
    """No capability, uid 1000 in its own user namespace, and outside it the unprivileged host uid
    (what it creates in the workspace is owned by RUNWARDEN_SANDBOX_UID, not host root)."""
    result = run(agent, "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; echo ---; id -u; touch made-here")
    caps_text, uid = result["stdout"].split("---\n")
    caps = dict(re.findall(r"^(Cap\w+):\s+([0-9a-f]+)$", caps_text, re.M))
    assert set(caps) == {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"}, result
    assert all(int(value, 16) == 0 for value in caps.values()), caps
    assert uid == "1000\n", result
    owner, sandbox_uid = (agent.workspace / "made-here").stat().st_uid, Settings.from_env(agent.stack.env).sandbox_uid
    assert owner == sandbox_uid, (owner, sandbox_uid)


EAGAIN = b"fork: retry: Resource temporarily unavailable"  # bash, at the first fork the limit refuses
SLEEPERS = "for i in $(seq 1 2000); do sleep 60 & echo $i; done; echo all-spawned"
RECURSIVE = "bomb() { bomb | bomb & }; bomb; sleep 60"


@contextlib.contextmanager
def bomb_at_its_limit(agent, command: str) -> Iterator[tuple[str, Received]]:  # type: ignore[no-untyped-def]
    """A fork bomb held at its process limit: yields once its stream shows a fork refused
    (EAGAIN); then cancels it and waits for its end, which its events are completed with."""
    response = agent.shell(command, timeout_ms=60000, wait=None)
    assert response.status_code == 202, response.text
    task_id = response.json()["task_id"]
    ws = connect(agent, task_id, timeout=60)
    seen, stderr = Received(), b""
    try:
        while EAGAIN not in stderr:
            event = json.loads(ws.recv())
            seen.events.append(event)
            assert event["type"] != "exit", f"the bomb ended without meeting a limit: {event}"
            stderr = seen.bytes_of("stderr")
        yield task_id, seen
        cancel(agent, task_id)
        while seen.events[-1]["type"] != "exit":
            seen.events.append(json.loads(ws.recv()))
    finally:
        ws.close()
        ended(agent, task_id)  # the next test must not meet the bomb


def test_fork_bomb_is_limited_and_the_worker_survives(agent) -> None:
    """The process limit, not the timeout, stops the bomb: a fork is refused once the sandbox holds
    about as many processes as allowed, and none is started after. (bwrap, its init and bash count
    too, and so, for a moment, do the pool process's last calls' processes while the kernel lets
    their pids go: here up to ~30 of 256.)"""
    limit = Settings.from_env(agent.stack.env).sandbox_max_processes
    before = host_processes_of(agent.stack, "celery")
    with bomb_at_its_limit(agent, SLEEPERS) as (task_id, seen):
        pass
    spawned = seen.bytes_of("stdout").split()
    assert spawned == [str(i).encode() for i in range(1, len(spawned) + 1)], spawned[-3:]
    assert limit // 2 <= len(spawned) < limit, (len(spawned), limit)
    assert seen.exit["status"] == "cancelled" and seen.exit["timed_out"] is False, seen.exit
    assert run(agent, "echo still-serving")["stdout"] == "still-serving\n"
    assert host_processes_of(agent.stack, "celery") == before
    assert agent.stack.stack.died() is None


@pytest.mark.parametrize("bomb", [SLEEPERS, RECURSIVE], ids=["sleepers", "recursive"])
def test_fork_bomb_does_not_starve_a_neighbour(agent, make_agent, bomb: str) -> None:
    neighbour = make_agent()
    run(neighbour, "true")  # its workspace exists before the bomb
    with bomb_at_its_limit(agent, bomb):
        result = run(neighbour, "echo hi; (echo sub); /bin/echo forked")  # forks while the bomb is at its limit
        assert result["exit_code"] == 0 and result["stdout"] == "hi\nsub\nforked\n", result
    after = run(agent, "echo worker fine")
    assert after["stdout"] == "worker fine\n", after


def test_memory_hog_ends_without_killing_the_worker(agent) -> None:
    before = host_processes_of(agent.stack, "celery")
    result = run(agent, "dd if=/dev/zero of=/dev/null bs=1500M count=1 2>&1; echo rc=$?; "
                        "a=$(head -c 1100000000 /dev/zero | dd bs=1100M count=1 iflag=fullblock 2>&1); echo rc=$?",
                 timeout_ms=60000)
    assert result["timed_out"] is False, result  # the memory limit ended it, not the timeout
    assert "rc=0" not in result["stdout"], result  # dd could not get its 1.5 GB buffer
    output = result["stdout"] + result["stderr"]
    # refused by an rlimit (an allocation error) or ended by a memory cgroup (SIGKILL, 137)
    assert re.search(r"memory exhausted|cannot allocate|Cannot allocate|out of memory|rc=137", output), result
    # Where a cgroup bounds the tree, its limit is the one met, and the result says so (section 13).
    settings = Settings.from_env(agent.stack.env, require_jwt=False)
    bounded = Cgroups.detect(settings.sandbox_memory_bytes, settings.sandbox_max_processes) is not None
    assert result["termination"] == ("oom_killed" if bounded else "exited"), result
    assert run(agent, "echo still-serving")["stdout"] == "still-serving\n"
    assert host_processes_of(agent.stack, "celery") == before
    assert agent.stack.stack.died() is None


def test_file_size_limit_holds(agent) -> None:
    """RLIMIT_FSIZE: a file can reach the configured cap (1 GiB by default) but not grow past it.
    The writes land just below and just past the cap in sparse files, so no gigabyte is written."""
    cap_kib = Settings.from_env(agent.stack.env).sandbox_max_file_bytes // 1024
    result = run(agent, f"for f in /workspace/edge /tmp/edge; do "
                        f"dd if=/dev/zero of=$f bs=1024 seek={cap_kib - 1} count=1 2>/dev/null; echo $?; done; "
                        f"for f in /workspace/past /tmp/past; do "
                        f"dd if=/dev/zero of=$f bs=1024 seek={cap_kib} count=1 2>/dev/null; echo $?; done; "
                        "stat -c %s /workspace/edge /tmp/edge /workspace/past /tmp/past")
    codes, sizes = result["stdout"].split()[:4], result["stdout"].split()[4:]
    assert codes[:2] == ["0", "0"], result  # up to the cap: written
    assert codes[2:] == ["153", "153"], result  # past it: SIGXFSZ (128 + 25) ends dd
    assert sizes == [str(cap_kib * 1024)] * 4, result  # nothing past the cap
    assert "File size limit exceeded" in result["stderr"]


def test_new_session_blocks_tty_injection(agent) -> None:
    """--new-session: the command runs in a session made inside the sandbox (its init leads it),
    so no terminal of the worker's session is its controlling terminal to push input into with
    TIOCSTI (CVE-2017-5226). Without it the session is the worker's, led outside: shown as 0."""
    result = run(agent, "cat /proc/$$/stat /proc/1/stat; exec 3<>/dev/tty 2>/dev/null && echo HAS-TTY || echo no-tty")
    *stats, tty = result["stdout"].splitlines()
    # /proc/PID/stat after the ")" ending the name: state ppid pgrp session tty_nr
    (command_sid, command_tty), (init_sid, _) = [tuple(map(int, line.rsplit(")", 1)[1].split()[3:5])) for line in stats]
    assert init_sid == 1 and command_sid == 1, result  # the sandbox's init (PID 1) leads the session
    assert command_tty == 0 and tty == "no-tty", result


def test_pid_1_is_the_sandbox_init(agent) -> None:
    """Inside the PID namespace PID 1 is the sandbox's own init (bwrap, whose parent is outside), the
    only processes are the sandbox's, and no host process, the worker's included, can be signalled."""
    host_pids = [p.pid for _, p in agent.stack.stack.children] + host_processes_of(agent.stack, "celery")
    host_pids = [pid for pid in host_pids if pid > 50]  # never a number the sandbox's own pids could take
    result = run(agent, "grep -E '^(Name|PPid):' /proc/1/status; echo ---; "
                        "for p in /proc/[0-9]*; do echo \"$(cat $p/comm)\"; done 2>/dev/null | sort -u; echo ---; "
                        f"for pid in {' '.join(map(str, host_pids))}; do kill -0 $pid 2>&1 | grep -o 'No such process'; done")
    init, names, signalled = result["stdout"].split("---\n")
    assert init == "Name:\tbwrap\nPPid:\t0\n", result
    assert set(names.split()) <= {"bwrap", "bash", "cat", "sort"}, names
    assert signalled.split("\n")[:-1] == ["No such process"] * len(host_pids), result


def test_concurrent_sandboxes_cannot_see_each_other(agent, make_agent) -> None:
    """A peer sandbox, held running (it waits for a file), is seen from the host but not by a probe."""
    other = make_agent()
    marker = f"rw-peer-{uuid.uuid4().hex[:8]}"
    # The marker is in the argv of the peer's inner bash, so the host sees it in a command line.
    peer = other.shell(f"echo {marker} > /tmp/{marker}; touch ready; "
                       f"bash -c 'while [ ! -e go ]; do sleep 0.05; done' {marker}", wait=None)
    assert peer.status_code == 202, peer.text
    peer_id = peer.json()["task_id"]
    try:
        wait_until(lambda: (other.workspace / "ready").exists(), 60, "the peer to be running")
        # `ready` comes just before the inner bash starts, whose argv holds the marker
        wait_until(lambda: host_processes_with(marker), 30, "the peer's command to be visible from the host")
        probe = run(agent, "ps -eo args; ls -A /tmp; cat /proc/[0-9]*/cmdline; echo end")
        assert probe["stdout"].endswith("end\n")
        assert marker not in probe["stdout"], probe
        assert other.get(peer_id).json()["status"] == "running"  # it was alive the whole time
    finally:
        (other.workspace / "go").touch()
    final = ended(other, peer_id)
    assert final["status"] == "completed" and final["result"]["exit_code"] == 0, final

