"""HTTP-level attacks on the API server: stalled requests (slowloris on headers and body), requests
gunicorn itself refuses (oversized, malformed), forwarding headers that would shape `stream_url`,
and special files in a workspace. Raw sockets, so the bytes sent are exactly the attack's."""
from __future__ import annotations

import os
import stat
import uuid

import requests

from tests.conftest import Agent
from workers.patching import ZERO_SHA

PROBLEM_JSON = "application/problem+json"


# --- 6. Special files in the workspace --------------------------------------------------------


def assert_path_forbidden(response: requests.Response) -> None:
    assert response.status_code == 403, response.text
    assert response.headers["Content-Type"] == PROBLEM_JSON
    assert response.json()["code"] == "path_forbidden"


def special_files(agent: Agent) -> list[str]:
    """A Unix socket made inside the sandbox, and (where this host lets the test make them) a
    character device with a driver and one without."""
    made = agent.shell("python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"", wait=60)
    assert made.json()["result"]["exit_code"] == 0, made.text
    names = ["sock"]
    for name, device in (("null-dev", os.makedev(1, 3)), ("no-driver-dev", os.makedev(511, 0))):
        try:
            os.mknod(agent.workspace / name, stat.S_IFCHR | 0o600, device)
        except PermissionError:
            continue  # no CAP_MKNOD here: the socket alone takes the same path (open fails)
        names.append(name)
    return names


def test_special_files_are_refused_as_path_forbidden(agent: Agent) -> None:
    worker_log = agent.stack.logs / "worker0.log"
    start = worker_log.stat().st_size
    for name in special_files(agent):
        key = uuid.uuid4().hex
        read_call = str(uuid.uuid4())
        for _ in range(2):  # the retry with the same key is answered the same way
            assert_path_forbidden(agent.call("read_file", {"path": name}, key=key, call_id=read_call))
        patch = {"path": name, "diff": f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1 @@\n+x\n", "base_sha": ZERO_SHA}
        key, patch_call = uuid.uuid4().hex, str(uuid.uuid4())
        for _ in range(2):
            assert_path_forbidden(agent.call("apply_file_patch", patch, key=key, call_id=patch_call))
    assert stat.S_ISSOCK((agent.workspace / "sock").lstat().st_mode)  # nothing replaced it
    added = worker_log.read_bytes()[start:]  # written before each call's answer
    assert b"Traceback" not in added and b"No such device or address" not in added
