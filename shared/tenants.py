"""Tenant quotas (contract section 10): defaults from the settings, overrides kept in Redis.

Every API process reads a tenant's overrides inside the admission script, in the round trip that
claims the call, so `runwarden tenant set` applies from the next call on every replica at once.
A limit of 0 means unlimited.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import redis

from shared import keys
from shared.settings import Settings


@dataclass(frozen=True)
class Quotas:
    max_running: int  # calls queued or running at once
    calls_per_minute: int
    output_bytes_per_hour: int  # stdout and stderr of the tenant's shell calls
    workspace_bytes: int  # of one workspace: an upload or clone past it is refused

    @classmethod
    def defaults(cls, settings: Settings) -> "Quotas":
        return cls(settings.tenant_max_running, settings.tenant_calls_per_minute,
                   settings.tenant_output_bytes_per_hour, settings.tenant_workspace_bytes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def overrides(client: redis.Redis, tenant: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(keys.tenant_quotas(tenant)).items()}


def effective(client: redis.Redis, settings: Settings, tenant: str) -> Quotas:
    """The tenant's quotas: its overrides over the defaults."""
    return Quotas(**(asdict(Quotas.defaults(settings)) | overrides(client, tenant)))


def set_overrides(client: redis.Redis, tenant: str, values: dict[str, int]) -> None:
    unknown = set(values) - set(Quotas.names())
    if unknown:
        raise ValueError(f"unknown quotas: {', '.join(sorted(unknown))}")
    if any(value < 0 for value in values.values()):
        raise ValueError("a quota is a number of at least 0 (0: unlimited)")
    if values:
        client.hset(keys.tenant_quotas(tenant), mapping=values)
