"""One real stack per test session: redis-server, Celery worker processes (prefork), gunicorn API.

The workers are started as separate `celery -A workers.worker worker` processes (pytest-celery's
Docker-based setup cannot run here, and its in-process worker would not be the prefork pool the
contract describes). Tests stay isolated by using a fresh tenant/run per test, not by flushing Redis
under running workers.
"""
from __future__ import annotations

import json
import secrets
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from runwarden import devstack
from runwarden.dev import start_nodes
from shared import connections, tokens
from shared.settings import Settings


@dataclass
class StackInfo:
    base_url: str
    redis_url: str
    secret: str
    env: dict[str, str]
    workspaces: Path
    logs: Path
    stack: devstack.Stack
    redis: redis.Redis = field(repr=False)

    @property
    def ws_base(self) -> str:
        return self.base_url.replace("http://", "ws://", 1)


def reachable_workspaces() -> Path:
    """A workspaces root the sandbox's unprivileged uid can reach (pytest's temp dirs are 0700),
    so the session exercises the stronger mode: bwrap itself runs as that uid, not as root."""
    return devstack.reachable_dir("runwarden-ws-")


def stack_env(tmp: Path, redis_url: str, secret: str, **overrides: str) -> dict[str, str]:
    return devstack.child_env(**{
        "RUNWARDEN_REDIS_URL": redis_url,
        "RUNWARDEN_JWT_SECRET": secret,
        "RUNWARDEN_WORKSPACES": str(tmp / "workspaces"),
        "RUNWARDEN_LEASE": "3",
        "RUNWARDEN_KILL_GRACE_MS": "500",
        "RUNWARDEN_VISIBILITY_TIMEOUT": "120",
        "RUNWARDEN_DRAIN_S": "2",  # a stack stopped with streams open exits soon
        "PYTHONUNBUFFERED": "1",
        **overrides,
    })


def start_stack(tmp: Path, *, workers: int = 1, concurrency: int = 2, redis_url: str | None = None,
                nodes: int = 0, **overrides: str) -> StackInfo:
    """`nodes`: node placement with that many worker nodes (as `runwarden dev --nodes N`) instead
    of `workers` sharing one workspaces root."""
    stack = devstack.Stack()
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    redis_url = redis_url or devstack.start_redis(stack, tmp / "redis")
    secret = secrets.token_urlsafe(48)
    env = stack_env(tmp, redis_url, secret, **({"RUNWARDEN_PLACEMENT": "node"} if nodes else {}), **overrides)
    if nodes:
        start_nodes(stack, env, nodes, concurrency, logs)
    for index in range(0 if nodes else workers):
        devstack.start_worker(stack, env, concurrency=concurrency, name=f"w{index}-{uuid.uuid4().hex[:6]}",
                              log=logs / f"worker{index}.log")
    port = devstack.free_port()
    devstack.start_api(stack, env, "127.0.0.1", port, log=logs / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        devstack.wait_for(lambda: devstack.http_ok(f"{base}/readyz"), 90, "the stack", stack)
    except RuntimeError:
        stack.stop()
        raise
    return StackInfo(base, redis_url, secret, env, Path(env["RUNWARDEN_WORKSPACES"]), logs, stack,
                     connections.connect(Settings.from_env(env, require_jwt=False)))  # a Sentinel URL too


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    workspaces = reachable_workspaces()
    info = start_stack(tmp_path_factory.mktemp("stack"), RUNWARDEN_WORKSPACES=str(workspaces))
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)


class Agent:
    """An agent platform's view: one tenant, one run, a token, and helpers for calls."""

    def __init__(self, stack: StackInfo, tenant: str, run_id: str, scopes: list[str], paths: list[str],
                 commands: list[str] | None = None, ttl_s: int = 600) -> None:
        self.stack = stack
        self.tenant, self.run_id = tenant, run_id
        self.scopes, self.paths = scopes, paths
        self.token = tokens.mint(stack.secret.encode(), tenant=tenant, run_id=run_id, sub="agent-1",
                                 scopes=scopes, paths=paths, ttl_s=ttl_s, commands=commands)
        self.http = requests.Session()

    @property
    def workspace(self) -> Path:
        return self.stack.workspaces / self.tenant / self.run_id

    def headers(self, key: str | None = None, **extra: str) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        headers["Idempotency-Key"] = key or uuid.uuid4().hex
        headers.update(extra)
        return headers

    def call(self, tool_name: str, parameters: dict[str, Any], *, key: str | None = None,
             call_id: str | None = None, headers: dict[str, str] | None = None) -> requests.Response:
        body = {"tool_name": tool_name, "call_id": call_id or str(uuid.uuid4()), "parameters": parameters}
        return self.http.post(f"{self.stack.base_url}/v1/tool-calls", data=json.dumps(body),
                              headers=headers or self.headers(key), timeout=90)

    def shell(self, command: str, *, wait: int | None = 60, **parameters: Any) -> requests.Response:
        extra = {"Prefer": f"wait={wait}"} if wait else {}
        body = {"tool_name": "execute_shell_command", "call_id": str(uuid.uuid4()),
                "parameters": {"command": command, **parameters}}
        return self.http.post(f"{self.stack.base_url}/v1/tool-calls", data=json.dumps(body),
                              headers=self.headers(**extra), timeout=90)

    def get(self, task_id: str) -> requests.Response:
        return self.http.get(f"{self.stack.base_url}/v1/tool-calls/{task_id}",
                             headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def write(self, relpath: str, data: bytes) -> str:
        """Create a file through the API; returns its blob sha."""
        from workers.patching import ZERO_SHA, git_blob_sha
        diff = _creation_diff(relpath, data)
        response = self.call("apply_file_patch", {"path": relpath, "diff": diff, "base_sha": ZERO_SHA})
        assert response.status_code == 200, response.text
        return git_blob_sha(data)


def _creation_diff(relpath: str, data: bytes) -> str:
    lines = data.decode().split("\n")
    ends_with_newline = data.endswith(b"\n")
    if ends_with_newline:
        lines = lines[:-1]
    body = "".join(f"+{line}\n" for line in lines)
    if not ends_with_newline:
        body += "\\ No newline at end of file\n"
    return f"--- /dev/null\n+++ b/{relpath}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


ALL_SCOPES = ["files:read", "files:write", "shell:exec"]


@pytest.fixture
def agent(stack: StackInfo) -> Agent:
    return Agent(stack, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ALL_SCOPES, ["**"])


@pytest.fixture(params=["cold", "prepared"])
def sandbox_path(request: pytest.FixtureRequest, stack: StackInfo):  # type: ignore[no-untyped-def]
    """Each test that asks for it runs twice: its shell calls in sandboxes spawned cold, then in
    sandboxes the keeper prepared (tests/sandboxes.py), and checks they did."""
    from tests.sandboxes import SandboxPath
    path = SandboxPath(stack, request.param)
    path.start()
    yield path
    path.finish()


@pytest.fixture
def make_agent(stack: StackInfo):  # type: ignore[no-untyped-def]
    def make(scopes: list[str] | None = None, paths: list[str] | None = None, **kwargs: Any) -> Agent:
        return Agent(stack, kwargs.pop("tenant", f"t{uuid.uuid4().hex[:10]}"),
                     kwargs.pop("run_id", f"r{uuid.uuid4().hex[:8]}"),
                     ALL_SCOPES if scopes is None else scopes, ["**"] if paths is None else paths, **kwargs)
    return make
