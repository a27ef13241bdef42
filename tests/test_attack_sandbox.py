"""Escape attempts from inside the sandbox, through execute_shell_command.

The sandbox must show its run's workspace and the system's programs, and nothing else of the host:
no home directories, no secrets, no worker environment, no other workspace, no network, no host
processes, no capabilities; and its limits must protect the worker and its neighbours.
"""
from __future__ import annotations

import os
import re
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from tests.streams import connect


def run(agent, command: str, **parameters) -> dict:  # type: ignore[no-untyped-def]
    response = agent.shell(command, wait=30, **parameters)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "completed", body
    return body["result"]


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
    result = run(agent, "cat /etc/passwd; id -un")
    users = {line.split(":")[0] for line in result["stdout"].splitlines() if ":" in line}
    assert users <= {"sandbox", "nobody"}, result["stdout"]


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
                        f"touch /tmp/{marker} /workspace/{marker} && echo ok")
    assert "WROTE" not in result["stdout"], result
    assert result["stdout"].endswith("ok\n")
    assert (agent.workspace / marker).exists()
    for directory in ("/usr", "/usr/bin", "/usr/local", "/etc", "/etc/ssl", "/tmp", "/"):
        assert not (Path(directory) / marker).exists(), directory
    again = run(agent, f"ls /{marker} /etc/{marker} /tmp/{marker} 2>&1; echo end")
    assert again["stdout"].count("No such file") == 3, again  # nothing persists between calls


def test_each_call_gets_a_fresh_tmp(agent) -> None:
    marker = uuid.uuid4().hex
    assert run(agent, f"echo {marker} > /tmp/left-behind && cat /tmp/left-behind")["stdout"] == f"{marker}\n"
    result = run(agent, "ls -A /tmp; cat /tmp/left-behind 2>&1; echo end")
    assert marker not in result["stdout"]
    assert "No such file" in result["stdout"]


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
    result = run(agent, "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; id -u; "
                        "grep NoNewPrivs /proc/self/status")
    caps = dict(re.findall(r"^(Cap\w+):\s+([0-9a-f]+)$", result["stdout"], re.M))
    assert set(caps) == {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"}, result
    assert all(int(value, 16) == 0 for value in caps.values()), caps
    assert "\n0\n" not in f"\n{result['stdout']}"  # uid is not 0


def test_fork_bomb_is_limited_and_the_worker_survives(agent) -> None:
    before = host_processes_of(agent.stack, "celery")
    response = agent.shell("for i in $(seq 1 2000); do sleep 8 & done; echo all-spawned", timeout_ms=2500, wait=30)
    body = response.json()
    assert body["status"] == "completed", body
    result = body["result"]
    assert "all-spawned" not in result["stdout"]
    assert "Resource temporarily unavailable" in result["stderr"] or result["exit_code"] != 0, result
    assert run(agent, "echo still-serving")["stdout"] == "still-serving\n"
    assert host_processes_of(agent.stack, "celery") == before
    assert agent.stack.stack.died() is None


def test_fork_bomb_does_not_starve_a_neighbour(agent, make_agent) -> None:
    neighbour = make_agent()
    run(neighbour, "true")  # its workspace exists before the bomb
    response = agent.shell("for i in $(seq 1 2000); do sleep 8 & done", timeout_ms=3000, wait=None)
    assert response.status_code == 202, response.text
    ws = connect(agent, response.json()["task_id"], timeout=15)
    saturated = False
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not saturated:
            frame = ws.recv()
            saturated = "Resource temporarily unavailable" in frame or "temporarily" in frame
    finally:
        ws.close()
    try:
        assert saturated, "the bomb never reached the process limit"
        result = run(neighbour, "echo hi; (echo sub)")
        assert result["exit_code"] == 0 and result["stdout"] == "hi\nsub\n", result
    finally:
        _wait_terminal(agent, response.json()["task_id"])  # the next test must not meet the bomb


def _wait_terminal(agent, task_id: str, timeout_s: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and agent.get(task_id).json()["status"] in ("queued", "running"):
        time.sleep(0.1)


def test_memory_hog_ends_without_killing_the_worker(agent) -> None:
    before = host_processes_of(agent.stack, "celery")
    started = time.monotonic()
    result = run(agent, "dd if=/dev/zero of=/dev/null bs=1500M count=1 2>&1; echo rc=$?; "
                        "a=$(head -c 1100000000 /dev/zero | dd bs=1100M count=1 iflag=fullblock 2>&1); echo rc=$?",
                 timeout_ms=30000)
    assert time.monotonic() - started < 30
    assert "rc=0" not in result["stdout"], result  # dd could not get its 1.5 GB buffer
    output = result["stdout"] + result["stderr"]
    # refused by an rlimit (an allocation error) or ended by a memory cgroup (SIGKILL, 137)
    assert re.search(r"memory exhausted|cannot allocate|Cannot allocate|out of memory|rc=137", output), result
    assert run(agent, "echo still-serving")["stdout"] == "still-serving\n"
    assert host_processes_of(agent.stack, "celery") == before
    assert agent.stack.stack.died() is None


def test_file_size_limit_holds(agent) -> None:
    """RLIMIT_FSIZE: a single file cannot grow past the configured cap (1 GiB by default)."""
    result = run(agent, "ulimit -f", timeout_ms=5000)
    blocks = result["stdout"].strip()
    assert blocks != "unlimited" and int(blocks) * 1024 <= 1024 ** 3, result


def test_new_session_blocks_tty_injection(agent) -> None:
    """--new-session: the command has no controlling terminal to push input into (CVE-2017-5226)."""
    result = run(agent, "exec 3<>/dev/tty 2>/dev/null && echo HAS-TTY || echo no-tty; "
                        "ps -o sid= -p $$; ps -o sid= -p 1")
    assert result["stdout"].startswith("no-tty"), result


def test_pid_1_is_the_sandbox_init(agent) -> None:
    """Inside the PID namespace nothing of the worker exists to signal; PID 1 is the sandbox's own init."""
    result = run(agent, "kill -0 1 2>&1 && echo can-signal-1; cat /proc/1/status | grep -E '^(Name|Uid)'")
    assert "celery" not in result["stdout"] and "python" not in result["stdout"]


def test_concurrent_sandboxes_cannot_see_each_other(agent, make_agent) -> None:
    other = make_agent()
    marker = f"rw-peer-{uuid.uuid4().hex[:8]}"
    results: dict[str, dict] = {}

    def sleeper() -> None:
        results["peer"] = run(other, f"echo {marker} > /tmp/{marker}; exec -a {marker} sleep 1.5")

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.6)
    results["probe"] = run(agent, "ps -eo args; ls -A /tmp; echo end")
    thread.join()
    assert results["probe"]["stdout"].endswith("end\n")
    assert marker not in results["probe"]["stdout"], results["probe"]
    assert results["peer"]["exit_code"] == 0
