"""What a worker holds, built once, as api/runtime.py is for the API.

- `Host`: built in the worker's main process at its start (`install`, from workers/worker.py), then
  filled by its start-up (workers/lifecycle.py): the settings, the runner whose self-test passed or
  why none did. Pool processes fork from it and inherit it.
- `Runtime`: built in each pool process after the fork (Redis connections must not cross one), on
  its first task, and found through `current()`.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shared import connections, keys
from shared.records import Records
from shared.settings import Settings
from workers import workspace
from workers.files import PatchApplier
from workers.holds import Holds
from workers.patch_sets import PatchSets
from workers.sandbox import Runner

# "host:pid" of the worker's main process (this module is imported before the pool forks): the
# Celery node an operator sees in Flower, recorded on each call it runs.
WORKER_NAME = f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Host:
    """The worker's main process's part, inherited by every pool process."""

    settings: Settings
    runner: Runner | None = None
    sandbox_error: str | None = None  # why shell calls are refused, when there is no runner

    @property
    def sandbox_owner(self) -> int | None:
        """The host uid the sandboxes run as, which owns the workspaces (None: the worker's own)."""
        return getattr(self.runner, "host_uid", None)


_host: Host | None = None


def install(settings: Settings) -> Host:
    """The worker's Host, made once by its entry point, before anything forks."""
    global _host
    _host = Host(settings)
    return _host


def host() -> Host:
    if _host is None:
        raise RuntimeError("workers.runtime.install() has not run: start workers with `celery -A workers.worker`")
    return _host


@dataclass
class Runtime:
    """One pool process's resources."""

    settings: Settings
    redis: redis.Redis
    records: Records
    patches: PatchApplier
    runner: Runner | None
    sandbox_error: str | None
    sandbox_owner: int | None
    control: redis.client.PubSub  # one connection per process, subscribed to its one channel
    holds: Holds  # test mode only; off in production
    patch_sets: PatchSets = field(init=False)
    name: str = WORKER_NAME
    pid: int = field(default_factory=os.getpid)

    @property
    def control_channel(self) -> str:
        """Where this pool process hears the signals and cancels of the shell calls it runs."""
        return keys.pool_control(self.name, self.pid)

    @classmethod
    def build(cls, host: Host) -> "Runtime":
        settings = host.settings
        # Named, so an operator's CLIENT LIST tells a pool process's connections from Celery's own.
        # socket_timeout: above the longest blocking read here (the control channel's polls are short).
        client = connections.connect(settings, health_check_interval=30, socket_timeout=30,
                                     client_name=f"runwarden-pool-{os.getpid()}")
        records = Records(client, ttl_s=settings.idempotency_ttl_s, retention_s=settings.stream_retention_s,
                          lease_s=settings.lease_s)
        built = cls(settings, client, records, PatchApplier(client, settings.idempotency_ttl_s, settings.workspaces),
                    host.runner, host.sandbox_error, host.sandbox_owner, client.pubsub(),
                    Holds(settings.test_hold_dir))
        built.patch_sets = PatchSets(client, built.patches, records, built.workspace, built.holds,
                                     lease_s=settings.lease_s, intent_ttl_s=settings.idempotency_ttl_s,
                                     worker=built.name)
        return built

    def workspace(self, tenant: str, run_id: str) -> Path:
        return workspace.workspace_dir(self.settings.workspaces, tenant, run_id, self.sandbox_owner)

    def has_workspace(self, tenant: str, run_id: str) -> bool:
        """Whether the run's workspace is here already (`workspace` makes it)."""
        return workspace.run_path(self.settings.workspaces, tenant, run_id).is_dir()


_current: Runtime | None = None


def current() -> Runtime:
    """This pool process's Runtime, built on first use after the fork."""
    global _current
    if _current is None or _current.pid != os.getpid():
        _current = Runtime.build(host())
    return _current
