"""Idempotency-Key parsing and the atomic claim of a (tenant, key) pair.

Policy (contract section 4):
- the claim and the task record are created by one Lua script, so of N identical requests one wins;
- a refusal before the claim (400/401/403/413/429) writes nothing, so a retry can succeed;
- once claimed, the record is only ever completed, never deleted because the outcome was an error:
  the tool's own outcome (2xx, 404 file, 412, 422 patch) is what a retry replays;
- the claim is released (compare-and-delete, only if still ours and still queued) only when nothing
  ran: the broker refused the message.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys
from shared.errors import InvalidIdempotencyKey, MissingIdempotencyKey, RateLimited, Unauthorized
from shared.schema import whole
from shared.tokens import REVOKED

KEY_RE = re.compile(whole("[A-Za-z0-9._:-]{1,255}"))  # also the OpenAPI pattern


def parse_key(values: list[str]) -> str:
    """The key from the header's values: exactly one, optionally in double quotes."""
    if not values:
        raise MissingIdempotencyKey("Send an Idempotency-Key header (a UUID is a good choice).")
    if len(values) > 1:
        raise InvalidIdempotencyKey("Idempotency-Key was sent more than once.")
    value = values[0].strip(" \t")  # the header's optional whitespace (RFC 9110), not \n or \v
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not KEY_RE.fullmatch(value):
        raise InvalidIdempotencyKey("Idempotency-Key must be 1-255 characters from A-Z a-z 0-9 . _ : -")
    return value


def fingerprint(run_id: str, tool_name: str, call_id: str, parameters: dict[str, Any]) -> str:
    """Identifies "the same request": a retry must match it, anything else is a reused key."""
    canonical = json.dumps([run_id, tool_name, call_id, parameters], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# KEYS: idempotency record, task record, done list, the tenant's rate counter for this second, and
#       the token's revocation marker if it has a jti.
# ARGV: fingerprint, task id, ttl ms, tenant, run id, call id, tool name, created ms, accepted code,
#       accepted body, rate limit per second.
# The revocation and rate checks come first and claim nothing when they refuse, so a retry can succeed.
_CLAIM = """
if KEYS[5] and redis.call('EXISTS', KEYS[5]) == 1 then return 'revoked' end
local calls = redis.call('INCR', KEYS[4])
if calls == 1 then redis.call('EXPIRE', KEYS[4], 2) end
if calls > tonumber(ARGV[11]) then return 'rate_limited' end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HMGET', KEYS[1], 'fp', 'task_id', 'state', 'code', 'body')
end
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'task_id', ARGV[2], 'state', 'pending',
           'code', ARGV[9], 'body', ARGV[10])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[2], KEYS[3])  -- what a claim released after a server failure left
redis.call('HSET', KEYS[2], 'tenant', ARGV[4], 'run_id', ARGV[5], 'call_id', ARGV[6],
           'tool_name', ARGV[7], 'status', 'queued', 'created_ms', ARGV[8], 'idem', KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return false
"""

# KEYS: idempotency record, task record. ARGV: task id.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'task_id') == ARGV[1] and redis.call('HGET', KEYS[1], 'state') == 'pending'
   and redis.call('HGET', KEYS[2], 'status') == 'queued' then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Existing:
    """The record a retry found: same request or not, finished or not, and what to replay."""

    fingerprint: str
    task_id: str
    done: bool
    code: int | None
    body: bytes


class Idempotency:
    def __init__(self, client: redis.Redis, ttl_s: int, rate_limit_per_s: int) -> None:
        self.client = client
        self.ttl_ms = ttl_s * 1000
        self.rate_limit_per_s = rate_limit_per_s
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)

    def claim(
        self,
        *,
        tenant: str,
        key: str,
        fp: str,
        run_id: str,
        call_id: str,
        tool_name: str,
        created_ms: int,
        accepted: tuple[int, bytes] | None = None,
        jti: str | None = None,
    ) -> Existing | None:
        """Claim the key and create the task record atomically; None when this request won.
        Refuses a revoked token (by its `jti`) and a tenant over its rate, claiming nothing."""
        task_id = keys.task_id_for(tenant, key)
        code, body = accepted if accepted else ("", b"")
        revoked = [keys.revoked_jti(jti)] if jti is not None else []
        found = self._claim(
            keys=[keys.idempotency(tenant, key), keys.task(task_id), keys.done(task_id),
                  keys.rate(tenant, created_ms // 1000), *revoked],
            args=[fp, task_id, self.ttl_ms, tenant, run_id, call_id, tool_name, created_ms, code, body,
                  self.rate_limit_per_s],
        )
        if found == b"revoked":
            raise Unauthorized(REVOKED)
        if found == b"rate_limited":
            error = RateLimited(f"More than {self.rate_limit_per_s} tool calls per second for this tenant.")
            error.headers["Retry-After"] = "1"
            raise error
        if not found:
            return None
        fp_found, task_found, state, code_found, body_found = found
        return Existing(
            fingerprint=fp_found.decode(),
            task_id=task_found.decode(),
            done=state == b"done",
            code=int(code_found) if code_found else None,
            body=body_found or b"",
        )

    def release(self, tenant: str, key: str) -> bool:
        """Undo a claim whose message never reached the broker, only if still ours and untouched."""
        task_id = keys.task_id_for(tenant, key)
        return bool(self._release(keys=[keys.idempotency(tenant, key), keys.task(task_id)], args=[task_id]))

    def record_response(self, tenant: str, key: str, code: int, body: bytes) -> None:
        """Keep the response the API actually sent (a `Prefer: wait` 200) as the one to replay."""
        self.client.hset(keys.idempotency(tenant, key), mapping={"code": code, "body": body})
