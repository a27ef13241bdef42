"""The benchmark's own stack on loopback, started with runwarden.devstack like `runwarden dev` and the tests:
redis-server, the product worker (prefork, concurrency 2), the gunicorn API; plus the floor's
gunicorn app and floor worker, started through the same devstack functions so their settings are
the product's by construction (only the app module and the queue differ).
"""
from __future__ import annotations

import os
import secrets
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import redis

from bench import floor_sandbox
from bench.names import BARE_QUEUE, FLOOR_QUEUE
from runwarden import devstack
from shared.settings import Settings

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
API_APP = "api.app:create_app()"
FLOOR_APP = "bench.floor_app:create_app()"
WORKER_APP = "workers.worker"
FLOOR_WORKER_APP = "bench.floor_worker"
BARE_APP = "bench.bare:create_app()"
BARE_WORKER_APP = "bench.bare"


@dataclass
class BenchStack:
    stack: devstack.Stack
    root: Path
    logs: Path
    env: dict[str, str]
    secret: str
    redis_url: str
    api_url: str
    floor_url: str
    api: Popen[bytes]
    worker: Popen[bytes]
    floor_api: Popen[bytes]
    floor_worker: Popen[bytes]
    settings: Settings
    bare_url: str = ""

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class _Retarget(devstack.Stack):
    """Hands a devstack start function's argv to the real stack with arguments swapped, so the floor
    server runs with the API's exact gunicorn flags (and the floor worker with the worker's), and the
    bare ones with the same flags but gunicorn's stock worker class."""

    def __init__(self, real: devstack.Stack, name: str, old: str, new: str, **more: str) -> None:
        super().__init__()
        self.real, self.name, self.swaps = real, name, {old: new, **more}

    def start(self, name, argv, env, log=None):  # type: ignore[no-untyped-def,override]
        assert set(self.swaps) <= set(argv), (self.swaps, argv)
        return self.real.start(self.name, [self.swaps.get(arg, arg) for arg in argv], env, log)


def start(logs: Path, **extra_env: str) -> BenchStack:
    stack = devstack.Stack()
    root = devstack.reachable_dir("runwarden-bench-")  # so bwrap runs unprivileged, as in the tests
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    try:
        redis_url = devstack.start_redis(stack, root / "redis")
        # The pub/sub floor publishes faster than one subscriber drains; let Redis buffer it (the
        # product's relay is a Redis Stream, which has no such limit) instead of dropping the subscriber.
        redis.Redis.from_url(redis_url).config_set("client-output-buffer-limit", "pubsub 0 0 0")
        secret = secrets.token_urlsafe(36)  # 48 characters
        env = devstack.child_env(**{
            "RUNWARDEN_REDIS_URL": redis_url,
            "RUNWARDEN_JWT_SECRET": secret,
            "RUNWARDEN_WORKSPACES": str(root / "workspaces"),
            "RUNWARDEN_KILL_GRACE_MS": "500",  # only cancels use it: the idle streams are cancelled at the end
            # `BENCH_PREPARED=0` measures every shell call with a cold sandbox (the product's default: 4).
            "RUNWARDEN_PREPARED_SANDBOXES": os.environ.get("BENCH_PREPARED", "4"),
            "RUNWARDEN_RATE_LIMIT": "1000000",  # the per-tenant limit is still checked on every call, never hit
            "BENCH_FLOOR_ROOT": str(root / "floor"),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **extra_env,
        })
        settings = Settings.from_env(env)
        # writes the floor's /etc files before its worker starts; the bare floor runs the same bwrap
        env[floor_sandbox.BARE_BWRAP_ENV] = floor_sandbox.build(settings, root / "floor").bare.bwrap
        tag = uuid.uuid4().hex[:6]
        worker = devstack.start_worker(stack, env, concurrency=2, name=f"bench-{tag}", log=logs / "worker.log")
        floor_worker = devstack.start_worker(_Retarget(stack, "floor-worker", WORKER_APP, FLOOR_WORKER_APP), env,
                                             concurrency=2, name=f"floor-{tag}", queues=FLOOR_QUEUE,
                                             log=logs / "floor-worker.log")
        devstack.start_worker(_Retarget(stack, "bare-worker", WORKER_APP, BARE_WORKER_APP), env, concurrency=2,
                              name=f"bare-{tag}", queues=BARE_QUEUE, log=logs / "bare-worker.log")
        api_port, floor_port, bare_port = devstack.free_port(), devstack.free_port(), devstack.free_port()
        api = devstack.start_api(stack, env, HOST, api_port, log=logs / "api.log")
        floor_api = devstack.start_api(_Retarget(stack, "floor-api", API_APP, FLOOR_APP), env, HOST, floor_port,
                                       log=logs / "floor-api.log")
        devstack.start_api(_Retarget(stack, "bare-api", API_APP, BARE_APP, **{"api.server.Worker": "gthread"}),
                           env, HOST, bare_port, log=logs / "bare-api.log")
        api_url, floor_url = f"http://{HOST}:{api_port}", f"http://{HOST}:{floor_port}"
        bare_url = f"http://{HOST}:{bare_port}"
        devstack.wait_for(lambda: devstack.http_ok(f"{api_url}/readyz"), 90, "the runwarden stack", stack)
        devstack.wait_for(lambda: devstack.http_ok(f"{floor_url}/healthz"), 60, "the floor app", stack)
        devstack.wait_for(lambda: devstack.http_ok(f"{bare_url}/healthz"), 60, "the bare app", stack)
        devstack.wait_for(lambda: _floor_worker_answers(floor_url), 60, "the floor worker", stack)
        devstack.wait_for(lambda: _floor_worker_answers(bare_url), 60, "the bare worker", stack)
    except BaseException:
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)
        raise
    return BenchStack(stack, root, logs, env, secret, redis_url, api_url, floor_url, api, worker, floor_api,
                      floor_worker, settings, bare_url)


def restart_api(bench: BenchStack, **settings: str) -> None:
    """Replace the API process with one started with `settings` added to the stack's environment."""
    devstack.stop_process(bench.api)
    bench.stack.children = [(name, child) for name, child in bench.stack.children if child is not bench.api]
    port = devstack.free_port()
    bench.api = devstack.start_api(bench.stack, {**bench.env, **settings}, HOST, port,
                                   log=bench.logs / f"api-{port}.log")
    bench.api_url = f"http://{HOST}:{port}"
    devstack.wait_for(lambda: devstack.http_ok(f"{bench.api_url}/readyz"), 90, "the restarted API", bench.stack)


def _floor_worker_answers(floor_url: str) -> bool:
    import urllib.request
    try:
        request = urllib.request.Request(f"{floor_url}/sandbox", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status == 200
    except OSError:
        time.sleep(0.5)
        return False


# --- processes and memory ---------------------------------------------------------------------------

def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command's name) of every process now; the
    first field is the state, the second the parent's pid."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                yield int(entry), stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile


def children(pid: int) -> list[int]:
    return [child for child, fields in proc_stats() if int(fields[1]) == pid]


def same_program_children(pid: int) -> list[int]:
    """Children running the same executable (the pool processes or gunicorn workers, not bwrap)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return []
    kids = []
    for child in children(pid):
        try:
            if os.readlink(f"/proc/{child}/exe") == exe:
                kids.append(child)
        except OSError:
            pass
    return sorted(kids)


def status_field(pid: int, name: str) -> int:
    """A number from /proc/<pid>/status (`VmRSS` in KiB, `Threads`), 0 if absent."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{name}:"):
                return int(line.split()[1])
    return 0


def rss_kib(pid: int) -> int:
    return status_field(pid, "VmRSS")


def api_worker_pid(bench: BenchStack) -> int:
    kids = same_program_children(bench.api.pid)
    if len(kids) != 1:
        raise RuntimeError(f"expected one gunicorn worker under {bench.api.pid}, found {kids}")
    return kids[0]


def worker_rss(bench: BenchStack) -> dict[str, int]:
    """VmRSS (KiB) of the celery main process and each pool child."""
    main = bench.worker.pid
    out = {f"main:{main}": rss_kib(main)}
    for child in same_program_children(main):
        out[f"child:{child}"] = rss_kib(child)
    return out
