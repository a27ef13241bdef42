"""Fair scheduling across tenants: calls start in turn across the tenants that have work waiting.

Celery still carries every call (Flower and `celery inspect` see it, under its own task id), but a
Celery queue only ever holds about as many calls as the pool can start: its *capacity*, the pool
processes of the live workers consuming it (each worker's heartbeat says how many it has). A call
beyond that is published to its tenant's *hold queue* (`<queue>.hold.<tenant>`, an ordinary kombu
queue no worker consumes), and its tenant joins the queue's *ring*. Whenever a call ends, in the
same Lua script that ends it, the next tenant of the ring gives its oldest held message to the
Celery queue (moved as it is: the message Celery published), and goes to the back of the ring. So
one tenant's backlog delays another's call by about one call per pool process, not by the backlog.

A tenant that joins the ring goes to its front, as a new flow does in fq_codel: one call at a time
(an agent waiting on each result) is never queued behind a bulk tenant's turn. The ring and the
counts are sets and lists in Redis, so every API process and worker sees one scheduler; a
worker's periodic `heal` puts back what a crash left (a redelivered message lands in its hold
queue again; a call whose record is gone frees its slot).

Keys are built inside the scripts from the queue's and tenant's names (`keys.inflight("")` and the
like are their prefixes): runwarden's Redis is one instance (or a Sentinel-managed one), not a cluster.
"""
from __future__ import annotations

import time

import redis

from shared import keys

# Lua: the live capacity of `queue`, and `dispatch(queue, now)`, which moves held messages into
# the Celery queue while it is below capacity, taking tenants in turn. Shared by the claim (the
# direct path), the scripts that end a call, `kick` and `heal`.
DISPATCH = f"""
local INFLIGHT, RING, MEMBERS = '{keys.inflight("")}', '{keys.ring("")}', '{keys.ring_members("")}'
local WORKERS, CONCURRENCY, TASK = '{keys.queue_workers("")}', '{keys.CONCURRENCY}', '{keys.task("")}'
local LEASE = '{keys.lease("")}'
local HOLD, HOLDERS = '{keys.HOLD_INFIX}', '{keys.ring_holders("")}'
local function capacity(queue, now)
  redis.call('ZREMRANGEBYSCORE', WORKERS .. queue, 0, now)  -- heartbeats that stopped
  local total = 0
  for _, name in ipairs(redis.call('ZRANGE', WORKERS .. queue, 0, -1)) do
    total = total + tonumber(redis.call('HGET', CONCURRENCY, name) or '1')
  end
  return total
end
local function dispatch(queue, now)
  local moved, limit = 0, capacity(queue, now)
  while redis.call('SCARD', INFLIGHT .. queue) < limit do
    local tenant = redis.call('LMOVE', RING .. queue, RING .. queue, 'LEFT', 'RIGHT')
    if not tenant then break end
    local message = redis.call('RPOP', queue .. HOLD .. tenant)  -- kombu pushes left, pops right
    if message then
      local id = cjson.decode(message)['headers']['id']
      local status = redis.call('HGET', TASK .. id, 'status')
      if status == 'queued' or status == 'running' then  -- a cancelled or forgotten call is dropped
        redis.call('SADD', INFLIGHT .. queue, id)
        redis.call('HSET', TASK .. id, 'dispatched_ms', now)
        redis.call('LPUSH', queue, message)
        moved = moved + 1
      end
    else  -- its turn found nothing: it leaves the ring (it was rotated to the back)
      redis.call('RPOP', RING .. queue)
      redis.call('SREM', MEMBERS .. queue, tenant)
    end
  end
  return moved
end
local function ended(task_key, task_id, now)  -- a call's end frees its slot and starts the next
  local queue = redis.call('HGET', task_key, 'queue')
  if queue then
    redis.call('SREM', INFLIGHT .. queue, task_id)
    dispatch(queue, now)
  end
end
"""

# KEYS: the queue's ring, its members set, its holders set. ARGV: queue, tenant, now ms.
# After a call was published to its tenant's hold queue: the tenant joins the ring (at the front),
# then whatever capacity there is is used.
_KICK = DISPATCH + """
if redis.call('SADD', KEYS[2], ARGV[2]) == 1 then redis.call('LPUSH', KEYS[1], ARGV[2]) end
redis.call('SADD', KEYS[3], ARGV[2])
return dispatch(ARGV[1], tonumber(ARGV[3]))
"""

# KEYS: the queue's workers (heartbeats), the concurrency hash, its ring, members, holders, inflight.
# ARGV: queue, worker name, pool processes, heartbeat expiry ms, now ms, how long a given call may
# stay queued before its slot is taken back (ms).
# A worker's heartbeat for one queue it consumes; then the repairs: a tenant whose hold queue holds
# messages but is not in the ring (a redelivered message went back there) rejoins it, and an
# in-flight slot whose call has ended or is gone is freed.
_HEAL = DISPATCH + """
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[5])) do
  if redis.call('LLEN', ARGV[1] .. HOLD .. tenant) > 0 then
    if redis.call('SADD', KEYS[4], tenant) == 1 then redis.call('RPUSH', KEYS[3], tenant) end
  elseif redis.call('SISMEMBER', KEYS[4], tenant) == 0 then
    redis.call('SREM', KEYS[5], tenant)
  end
end
local stale = tonumber(ARGV[5]) - tonumber(ARGV[6])
for _, id in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  local status, since = unpack(redis.call('HMGET', TASK .. id, 'status', 'dispatched_ms'))
  -- Ended or gone; or still queued long after it was given to the queue, whose message a crash
  -- lost (a claim whose reply never came back, an API that died before publishing): its slot
  -- comes back. Should its message exist after all, it still runs; the queue is over capacity by one.
  -- A slot given a minute ago is also taken back from a running call that holds no lease (a file
  -- call whose message a Redis restart left unacked until the visibility timeout): at worst the
  -- queue is over capacity by one while it really runs. A running shell call keeps its slot while
  -- its lease lives (a dead one is reaped as lost, which frees it).
  local old = tonumber(since or '0') < stale
  if (status ~= 'queued' and status ~= 'running') or (old and status == 'queued')
     or (old and redis.call('EXISTS', LEASE .. id) == 0) then
    redis.call('SREM', KEYS[6], id)
  end
end
return dispatch(ARGV[1], tonumber(ARGV[5]))
"""


# A call given to its Celery queue starts within about one call's time. One still queued half a
# minute later whose message is nowhere was lost to a crash and ends `lost` (shared/records.py,
# _LOSE_UNSENT); one still queued a minute later gives its slot back, message or not (see _HEAL).
UNSENT_AFTER_MS = 30_000
STALE_DISPATCH_MS = 60_000


def hold_queue(queue: str, tenant: str) -> str:
    """The kombu queue a tenant's calls wait in while `queue` is at capacity."""
    return f"{queue}{keys.HOLD_INFIX}{tenant}"


def now_ms() -> int:
    return int(time.time() * 1000)


class Scheduler:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._kick = client.register_script(_KICK)
        self._heal = client.register_script(_HEAL)

    def kick(self, queue: str, tenant: str) -> int:
        """The tenant has a call in its hold queue: put it in turn, and dispatch what fits."""
        return int(self._kick(keys=[keys.ring(queue), keys.ring_members(queue), keys.ring_holders(queue)],
                              args=[queue, tenant, now_ms()]))

    def heartbeat(self, queue: str, worker: str, processes: int, ttl_s: float) -> int:
        """This worker consumes `queue` with `processes` pool processes for the next `ttl_s`."""
        now = now_ms()
        return int(self._heal(
            keys=[keys.queue_workers(queue), keys.CONCURRENCY, keys.ring(queue), keys.ring_members(queue),
                  keys.ring_holders(queue), keys.inflight(queue)],
            args=[queue, worker, processes, now + int(ttl_s * 1000), now, STALE_DISPATCH_MS]))

    def leave(self, queue: str, worker: str) -> None:
        """A worker that stops takes its pool out of the queue's capacity at once."""
        self.client.zrem(keys.queue_workers(queue), worker)
