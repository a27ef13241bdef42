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
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys
from shared.audit import Audited
from shared.errors import InvalidIdempotencyKey, MissingIdempotencyKey, QuotaExceeded, RateLimited, Unauthorized
from shared.schema import whole
from shared import placement
from shared.placement import PLACE
from shared.scheduler import DISPATCH
from shared.tenants import Quotas
from shared.tokens import REVOKED

KEY_RE = re.compile(whole("[A-Za-z0-9._:-]{1,255}"))  # also the OpenAPI pattern
log = logging.getLogger("runwarden.idempotency")


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


# Admission, before anything is claimed: a refusal writes nothing, so a retry can succeed.
# KEYS: ... [4] the tenant's rate counter for this second, [5] the tenant's active set, [7] its
#       calls-per-minute counter, [8] its output-bytes counter for this hour, [9] its quota overrides,
#       [10], [11] the token's revocation markers, for every tenant and for its own (if it has a jti).
# ARGV: ... [11] rate limit per second, [12..14] default max_running, calls_per_minute,
#       output_bytes_per_hour (0: unlimited), [15] seconds to the next minute, [16] to the next hour.
# The rate counts every request; the quotas count admitted calls, so a retry of an existing call
# (a 409 or a replay) is never refused by them.
_ADMIT = """
local function rate_limited()
  local calls = redis.call('INCR', KEYS[4])
  if calls == 1 then redis.call('EXPIRE', KEYS[4], 2) end
  return calls > tonumber(ARGV[11])
end
local function quota(name, default)
  return tonumber(redis.call('HGET', KEYS[9], name) or default)
end
local function over_quota()
  local max_running = quota('max_running', ARGV[12])
  if max_running > 0 and redis.call('SCARD', KEYS[5]) >= max_running then return {'max_running', '1'} end
  local per_minute = quota('calls_per_minute', ARGV[13])
  if per_minute > 0 and tonumber(redis.call('GET', KEYS[7]) or '0') >= per_minute then
    return {'calls_per_minute', ARGV[15]}
  end
  local per_hour = quota('output_bytes_per_hour', ARGV[14])
  if per_hour > 0 and tonumber(redis.call('GET', KEYS[8]) or '0') >= per_hour then
    return {'output_bytes_per_hour', ARGV[16]}
  end
  return false
end
"""

# KEYS: [1] idempotency record, [2] task record, [3] done list, [4]-[5], [7]-[10] as _ADMIT,
#       [6] the run's active set.
# ARGV: [1] fingerprint, [2] task id, [3] ttl ms, [4] tenant, [5] run id, [6] call id, [7] tool name,
#       [8] created ms, [9] accepted code, [10] accepted body, [11]-[16] as _ADMIT, [17] the tool's
#       Celery queue; for the audit record (shared/audit.py), [18] the token's sub, [19] its jti ('' if
#       none), [20] the path or command, [21] the tenant's audit stream ('' for none), [22] its cap,
#       [23] the Idempotency-Key, [24] '1' under node placement (the call goes to its run's node's queue).
# Returns {'direct', queue} (claimed; the queue has room and nobody waits: publish to it) or
# {'hold', queue} (claimed; publish to the tenant's hold queue, then kick: shared/scheduler.py),
# the existing record (fp, task id, state, code, body), 'revoked', 'rate_limited',
# {'quota', name, retry-after} or {'down', node} (node placement: the run's node is down).
_CLAIM = _ADMIT + DISPATCH + PLACE + """
if KEYS[10] and redis.call('EXISTS', KEYS[10], KEYS[11]) > 0 then return 'revoked' end
if rate_limited() then return 'rate_limited' end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HMGET', KEYS[1], 'fp', 'task_id', 'state', 'code', 'body')
end
local queue = ARGV[17]
if ARGV[24] == '1' then  -- node placement: the run's node's queue, or 503 before claiming anything
  local node, down = place(ARGV[4], ARGV[5], tonumber(ARGV[8]))
  if not node then return {'down', down or ''} end
  queue = queue .. '@' .. node
end
local over = over_quota()
if over then return {'quota', over[1], over[2]} end
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'task_id', ARGV[2], 'state', 'pending',
           'code', ARGV[9], 'body', ARGV[10])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[2], KEYS[3])  -- what a claim released after a server failure left
redis.call('HSET', KEYS[2], 'tenant', ARGV[4], 'run_id', ARGV[5], 'call_id', ARGV[6],
           'tool_name', ARGV[7], 'status', 'queued', 'created_ms', ARGV[8], 'idem', KEYS[1],
           'active', KEYS[5], 'run_active', KEYS[6])
if ARGV[21] ~= '' then
  redis.call('HSET', KEYS[2], 'sub', ARGV[18], 'jti', ARGV[19], 'subject', ARGV[20], 'audit', ARGV[21],
             'audit_max', ARGV[22], 'key', ARGV[23])
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[5], ARGV[2])
redis.call('SADD', KEYS[6], ARGV[2])
if redis.call('INCR', KEYS[7]) == 1 then redis.call('EXPIRE', KEYS[7], 120) end
redis.call('HSET', KEYS[2], 'queue', queue)
if redis.call('LLEN', RING .. queue) == 0
   and redis.call('SCARD', INFLIGHT .. queue) < capacity(queue, tonumber(ARGV[8])) then
  redis.call('SADD', INFLIGHT .. queue, ARGV[2])
  redis.call('HSET', KEYS[2], 'dispatched_ms', ARGV[8])
  return {'direct', queue}
end
redis.call('SADD', HOLDERS .. queue, ARGV[4])  -- so that heal finds it, should the kick not come
return {'hold', queue}
"""

# KEYS: idempotency record, task record. ARGV: task id, now ms.
# The call's slots in its tenant's and run's active sets, and in its queue, go with it.
_RELEASE = DISPATCH + """
if redis.call('HGET', KEYS[1], 'task_id') == ARGV[1] and redis.call('HGET', KEYS[1], 'state') == 'pending'
   and redis.call('HGET', KEYS[2], 'status') == 'queued' then
  for _, set in ipairs(redis.call('HMGET', KEYS[2], 'active', 'run_active')) do
    if set then redis.call('SREM', set, ARGV[1]) end
  end
  ended(KEYS[2], ARGV[1], tonumber(ARGV[2]))
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
return 0
"""


def _audit_args(audit: Audited, tenant: str, jti: str | None, key: str) -> tuple[str | int, ...]:
    return audit.sub, jti or "", audit.subject, keys.audit(tenant), audit.maxlen, key


@dataclass(frozen=True)
class Admitted:
    """This request claimed the key: publish the call to its queue (`direct`) or to its tenant's
    hold queue, where the fair scheduler will take it from."""

    direct: bool
    queue: str  # the tool's queue, or under node placement its run's node's


@dataclass(frozen=True)
class Existing:
    """The record a retry found: same request or not, finished or not, and what to replay."""

    fingerprint: str
    task_id: str
    done: bool
    code: int | None
    body: bytes


class Idempotency:
    def __init__(self, client: redis.Redis, ttl_s: int, rate_limit_per_s: int, quotas: Quotas,
                 node_placement: bool = False) -> None:
        self.client = client
        self.node_placement = node_placement
        self.ttl_ms = ttl_s * 1000
        self.rate_limit_per_s = rate_limit_per_s
        self.quotas = quotas  # the defaults; a tenant's overrides are read by the script
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
        queue: str,
        accepted: tuple[int, bytes] | None = None,
        jti: str | None = None,
        audit: Audited | None = None,
    ) -> Existing | Admitted:
        """Claim the key and create the task record (with what its `audit` record says) atomically
        (`Admitted` if this request won). Refuses a revoked `jti`, a tenant over its rate or quotas."""
        task_id = keys.task_id_for(tenant, key)
        code, body = accepted if accepted else ("", b"")
        revoked = [keys.revoked_jti(jti), keys.revoked_jti(jti, tenant)] if jti is not None else []
        now_s = created_ms // 1000
        q = self.quotas
        found = self._claim(
            keys=[keys.idempotency(tenant, key), keys.task(task_id), keys.done(task_id), keys.rate(tenant, now_s),
                  keys.tenant_active(tenant), keys.run_active(tenant, run_id),
                  keys.calls_per_minute(tenant, now_s // 60), keys.output_bytes(tenant, now_s // 3600),
                  keys.tenant_quotas(tenant), *revoked],
            args=[fp, task_id, self.ttl_ms, tenant, run_id, call_id, tool_name, created_ms, code, body,
                  self.rate_limit_per_s, q.max_running, q.calls_per_minute, q.output_bytes_per_hour,
                  60 - now_s % 60, 3600 - now_s % 3600, queue,
                  *(_audit_args(audit, tenant, jti, key) if audit else ("", "", "", "", 0, "")),
                  "1" if self.node_placement else "0"],
        )
        if isinstance(found, list) and found and found[0] in (b"direct", b"hold"):
            return Admitted(direct=found[0] == b"direct", queue=found[1].decode())
        if isinstance(found, list) and found and found[0] == b"quota":
            raise QuotaExceeded(found[1].decode(), int(found[2]))
        if isinstance(found, list) and found and found[0] == b"down":
            raise placement.unavailable(found[1].decode())
        if found == b"revoked":
            raise Unauthorized(REVOKED)
        if found == b"rate_limited":
            error = RateLimited(f"More than {self.rate_limit_per_s} tool calls per second for this tenant.")
            error.headers["Retry-After"] = "1"
            raise error
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
        return bool(self._release(keys=[keys.idempotency(tenant, key), keys.task(task_id)],
                                  args=[task_id, int(time.time() * 1000)]))

    def record_response(self, tenant: str, key: str, code: int, body: bytes) -> None:
        """Keep the response the API actually sent (a `Prefer: wait` 200) as the one to replay."""
        self.client.hset(keys.idempotency(tenant, key), mapping={"code": code, "body": body})


class Releases:
    """Claims whose call never reached the broker, released now or as soon as Redis answers again.

    When Redis goes away between a claim and its message (a restart, a failover), the release fails
    too; left there, the claim would answer every retry with 409 until it expired, for a call that
    will never run. So a failed release is retried by a thread of this process, every RETRY_S for
    up to GIVE_UP_S. A release only ever undoes a claim still queued with no message: never one a
    later request enqueued (that one answered its client, or made it wait with 409).
    """

    RETRY_S = 0.5
    GIVE_UP_S = 600

    def __init__(self, idempotency: Idempotency) -> None:
        self.idempotency = idempotency
        self._pending: dict[tuple[str, str], float] = {}  # (tenant, key) → when to give up
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def release(self, tenant: str, key: str) -> None:
        try:
            self.idempotency.release(tenant, key)
        except redis.RedisError:
            with self._lock:
                self._pending[(tenant, key)] = time.monotonic() + self.GIVE_UP_S
                if self._thread is None:
                    self._thread = threading.Thread(target=self._retry_forever, name="runwarden-releases",
                                                    daemon=True)
                    self._thread.start()

    def _retry_forever(self) -> None:
        while True:
            time.sleep(self.RETRY_S)
            with self._lock:
                pending = list(self._pending.items())
            for (tenant, key), give_up in pending:
                try:
                    self.idempotency.release(tenant, key)
                except redis.RedisError:
                    if time.monotonic() < give_up:
                        continue
                    log.warning("gave up releasing a claim whose call never reached the broker")
                with self._lock:
                    self._pending.pop((tenant, key), None)
