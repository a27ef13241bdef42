"""RUNWARDEN_REDIS_URL naming Redis Sentinels (`sentinel://…;sentinel://…`, as Celery writes it):
parsed, refused when malformed, and a whole stack served through a real Sentinel, across a failover."""
from __future__ import annotations

import secrets
import shutil
import signal
import os
import time
import uuid
from pathlib import Path

import pytest
import redis

from runwarden import devstack
from shared import connections
from shared.celery_app import create_celery
from shared.settings import Settings, SettingsError
from tests.conftest import ALL_SCOPES, Agent, reachable_workspaces, start_stack
from tests.streams import watch
from tests.waiting import wait_until


def settings_for(url: str, **env: str) -> Settings:
    return Settings.from_env({"RUNWARDEN_REDIS_URL": url, **env}, require_jwt=False)


def test_sentinel_urls_are_parsed_as_celery_writes_them() -> None:
    found = connections.parse_sentinels("sentinel://:p%40ss@10.0.0.1:26380/2;sentinel://:p%40ss@s2;sentinel://s3:1")
    assert found == connections.Sentinels((("10.0.0.1", 26380), ("s2", 26379), ("s3", 1)), 2, None, "p@ss")
    assert connections.parse_sentinels("redis://:pw@localhost:6379/0") is None
    settings = settings_for("sentinel://s1;sentinel://s2", RUNWARDEN_REDIS_SENTINEL_MASTER="cluster1",
                            RUNWARDEN_REDIS_SENTINEL_PASSWORD="sentinel-pw")
    celery = create_celery(settings)
    for options in (celery.conf.broker_transport_options, celery.conf.result_backend_transport_options):
        assert options["master_name"] == "cluster1" and options["sentinel_kwargs"]["password"] == "sentinel-pw"
        assert options["visibility_timeout"] == settings.visibility_timeout_s
    assert celery.conf.broker_url == celery.conf.result_backend == "sentinel://s1;sentinel://s2"
    assert "master_name" not in create_celery(settings_for("redis://h")).conf.broker_transport_options


@pytest.mark.parametrize("url", ["sentinel://", "sentinel://h:99999", "sentinel://h/db", "sentinel://h;redis://x",
                                 "sentinel://:secret-pw@h?x=1"])
def test_malformed_sentinel_urls_stop_start_up_without_echoing_them(url: str) -> None:
    with pytest.raises(SettingsError) as refused:
        settings_for(url)
    assert "RUNWARDEN_REDIS_URL" in str(refused.value) and "secret-pw" not in str(refused.value)


def start_redis_node(stack: devstack.Stack, root: Path, name: str, password: str, *extra: str) -> int:
    port = devstack.free_port()
    data = root / name
    data.mkdir(parents=True)
    (data / "redis.conf").write_text(f"requirepass {password}\nmasterauth {password}\n")
    stack.start(name, [devstack.find_redis_server(), str(data / "redis.conf"), "--port", str(port), "--bind",
                       "127.0.0.1", "--save", "", "--appendonly", "yes", "--dir", str(data), *extra],
                os.environ.copy(), data / "redis.log")
    client = redis.Redis(port=port, password=password, socket_timeout=2)
    wait_until(lambda: _pings(client), 30, f"redis {name}")
    return port


def streamed(agent: Agent, text: str) -> bytes:
    """A shell call's stdout as its WebSocket stream relays it (the stream server's own Redis clients)."""
    started = agent.shell(f"echo {text}", wait=None)
    assert started.status_code == 202, started.text
    received = watch(agent, started.json()["task_id"])
    assert received.exit["exit_code"] == 0
    return received.bytes_of("stdout")


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def start_sentinel(stack: devstack.Stack, root: Path, master_port: int, password: str) -> int:
    port = devstack.free_port()
    config = root / "sentinel.conf"  # Sentinel rewrites its file: it must be writable
    config.write_text(f"port {port}\nbind 127.0.0.1\ndir {root}\n"
                      f"sentinel monitor mymaster 127.0.0.1 {master_port} 1\n"
                      f"sentinel auth-pass mymaster {password}\n"
                      "sentinel down-after-milliseconds mymaster 1000\n"
                      "sentinel failover-timeout mymaster 10000\n")
    stack.start("sentinel", [devstack.find_redis_server(), str(config), "--sentinel"], os.environ.copy(),
                root / "sentinel.log")
    sentinel = redis.Redis(port=port, socket_timeout=2)
    wait_until(lambda: _master_of(sentinel) == master_port, 30, "the Sentinel to watch the master")
    return port


def _master_of(sentinel: redis.Redis) -> int | None:
    try:
        return int(sentinel.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")[1])
    except (redis.RedisError, TypeError, IndexError):
        return None


@pytest.mark.timeout(240)
def test_a_stack_runs_through_a_sentinel_and_rides_a_failover(tmp_path: Path) -> None:
    """API and worker find the master through a real Sentinel; when the master dies, the Sentinel
    promotes its replica and the stack serves again without a restart (what a call in flight then
    sees is the README's, "Redis Sentinel")."""
    redis_stack, password = devstack.Stack(), secrets.token_hex(16)
    workspaces = reachable_workspaces()
    info = None
    try:
        master = start_redis_node(redis_stack, tmp_path, "master", password)
        replica = start_redis_node(redis_stack, tmp_path, "replica", password, "--replicaof", "127.0.0.1",
                                   str(master))
        sentinel_port = start_sentinel(redis_stack, tmp_path, master, password)
        url = f"sentinel://:{password}@127.0.0.1:{sentinel_port}/0"
        info = start_stack(tmp_path, redis_url=url, RUNWARDEN_WORKSPACES=str(workspaces))
        agent = Agent(info, f"t{uuid.uuid4().hex[:10]}", "run", ALL_SCOPES, ["**"])
        sha = agent.write("before.txt", b"written through the Sentinel\n")
        assert agent.call("read_file", {"path": "before.txt"}).json()["result"]["sha"] == sha
        assert agent.shell("echo through the sentinel").json()["result"]["stdout"] == "through the sentinel\n"
        assert streamed(agent, "through the sentinel") == b"through the sentinel\n"

        [master_process] = [p for name, p in redis_stack.children if name == "master"]
        os.killpg(master_process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        sentinel = redis.Redis(port=sentinel_port, socket_timeout=2)
        wait_until(lambda: _master_of(sentinel) == replica, 90, "the Sentinel to promote the replica", 0.2)

        def serves() -> bool:
            response = agent.shell("echo after the failover", wait=30)
            return response.status_code == 200 and response.json()["result"]["stdout"] == "after the failover\n"
        wait_until(serves, 90, "a shell call served by the new master", 0.5)
        assert streamed(agent, "after the failover") == b"after the failover\n"  # the stream server found it too
        print(f"\n[sentinel] failover: calls served again {time.monotonic() - killed_at:.1f} s after the master's kill")
        assert info.stack.died() is None
    finally:
        if info is not None:
            info.stack.stop()
        redis_stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)
