"""Node placement (contract section 14): with RUNWARDEN_PLACEMENT=node, a run lives on one worker
node's own disk, and every call of the run goes to that node's queues.

A node is a Celery worker started with RUNWARDEN_NODE; it consumes `<queue>@<node>` besides the
shared queues, and its heartbeat keeps it in `rw:nodes` (scored by when it expires). A run is
placed when its workspace is created or on its first call, on the live, undrained node with the
fewest runs; the claim's Lua script does it (`PLACE`), in the round trip that admits the call, so
routing costs no extra round trip. A run whose node is down (no heartbeat for
RUNWARDEN_NODE_TIMEOUT) is refused 503 `workspace_unavailable` before anything is claimed: nothing
is queued where nobody consumes, and a retry once the node is back runs. The node's queues get
their own fair-scheduling ring and capacity, by their names (shared/scheduler.py).
"""
from __future__ import annotations

import time

import redis

from shared import keys
from shared.errors import WorkspaceUnavailable

# Lua: `place(tenant, run, now)` → the run's node, placing it first if it has none; nil and the
# node's name when that node is down; nil alone when no node is live.
PLACE = f"""
local NODES, DRAINING = '{keys.NODES}', '{keys.DRAINING}'
local PLACEMENT, NODE_RUNS = '{keys.placement("", "")[:-1]}', '{keys.node_runs("")}'
local function place(tenant, run, now)
  local key = PLACEMENT .. tenant .. ':' .. run
  local node = redis.call('GET', key)
  if node then
    if tonumber(redis.call('ZSCORE', NODES, node) or '0') < now then return nil, node end
    return node
  end
  local best, fewest = nil, nil
  for _, name in ipairs(redis.call('ZRANGEBYSCORE', NODES, now, '+inf')) do
    if redis.call('SISMEMBER', DRAINING, name) == 0 then
      local runs = redis.call('SCARD', NODE_RUNS .. name)
      if not fewest or runs < fewest then best, fewest = name, runs end
    end
  end
  if not best then return nil end
  redis.call('SET', key, best)
  redis.call('SADD', NODE_RUNS .. best, tenant .. '/' .. run)
  return best
end
"""

# KEYS: none (built by PLACE). ARGV: tenant, run, now ms. Returns the node, or {'down', node|''}.
_PLACE = PLACE + """
local node, down = place(ARGV[1], ARGV[2], tonumber(ARGV[3]))
if node then return node end
return {'down', down or ''}
"""


def node_queue(queue: str, node: str) -> str:
    """The queue of `queue`'s tool calls for the runs placed on `node`."""
    return f"{queue}@{node}"


def unavailable(node: str) -> WorkspaceUnavailable:
    if node:
        return WorkspaceUnavailable(f"The node this run's workspace lives on ({node}) is not answering; "
                                    "retry when it is back, or delete the workspace to place the run again.")
    return WorkspaceUnavailable("No worker node is available to place this run on; retry shortly.")


class Placement:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._place = client.register_script(_PLACE)

    def place(self, tenant: str, run_id: str) -> str:
        """The run's node (placing the run if it has none); raises 503 if it cannot be served."""
        found = self._place(args=[tenant, run_id, int(time.time() * 1000)])
        if isinstance(found, list):
            raise unavailable(found[1].decode())
        return str(found.decode())

    def node_of(self, tenant: str, run_id: str) -> str | None:
        node = self.client.get(keys.placement(tenant, run_id))
        return node.decode() if node else None

    def require_live(self, tenant: str, run_id: str) -> None:
        """For a stream: 503 when the run's node is down (a run never placed has nothing to stream)."""
        node = self.node_of(tenant, run_id)
        if node is not None and (self.client.zscore(keys.NODES, node) or 0) < time.time() * 1000:
            raise unavailable(node)

    def free(self, tenant: str, run_id: str) -> None:
        """The run's workspace was deleted: its next call may be placed anywhere."""
        node = self.node_of(tenant, run_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(keys.placement(tenant, run_id))
        if node is not None:
            pipe.srem(keys.node_runs(node), f"{tenant}/{run_id}")
        pipe.execute()

    def heartbeat(self, node: str, ttl_s: float) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.zadd(keys.NODES, {node: int((time.time() + ttl_s) * 1000)})
        pipe.srem(keys.DRAINING, node)
        pipe.execute()

    def drain(self, node: str) -> None:
        """SIGTERM: the node takes no new run; its runs stay placed on it."""
        self.client.sadd(keys.DRAINING, node)
