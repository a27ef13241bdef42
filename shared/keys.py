"""The Redis vocabulary: every key name, channel, queue and status in one place."""
from __future__ import annotations

import enum
import hashlib
import uuid

PREFIX = "rw"
FILE_QUEUE = "runwarden.files"
SHELL_QUEUE = "runwarden.shell"

# A fixed namespace so the task id of (tenant, key) is the same on every API replica.
TASK_ID_NAMESPACE = uuid.UUID("5b0e7c1e-4d2a-4f0e-9a53-2f1d6c0b7a11")


class Status(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.LOST})


def task_id_for(tenant: str, idempotency_key: str) -> str:
    """A retry with the same key maps to the same Celery task id."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{tenant}\x00{idempotency_key}"))


def idempotency(tenant: str, key: str) -> str:
    """Hash: fingerprint, task id, state, and the response to replay."""
    return f"{PREFIX}:idem:{tenant}:{key}"


def task(task_id: str) -> str:
    """Hash: who owns the call, its status and its final result."""
    return f"{PREFIX}:task:{task_id}"


def execution(task_id: str) -> str:
    """String claimed with SET NX by the worker that runs the call: a redelivered message finds it taken."""
    return f"{PREFIX}:exec:{task_id}"


def lease(task_id: str) -> str:
    """String with a short TTL, refreshed while a worker runs the call (a shell call, or a patch set
    doing its renames: it names the actor doing them); its absence means the worker died."""
    return f"{PREFIX}:lease:{task_id}"


def log(task_id: str) -> str:
    """Stream: every output event of a shell call, entry id `<seq>-1`, for replay."""
    return f"{PREFIX}:log:{task_id}"


def live(task_id: str) -> str:
    """Pub/sub channel announcing each event as it is logged."""
    return f"{PREFIX}:live:{task_id}"


def done(task_id: str) -> str:
    """List pushed once when the call ends, so the API can wait with BLPOP instead of polling."""
    return f"{PREFIX}:done:{task_id}"


def control(task_id: str) -> str:
    """Pub/sub channel of one call, for a worker that does not record its own (an older version):
    signals and cancels go to the channel the call's start recorded (`pool_control`), else here."""
    return f"{PREFIX}:ctl:{task_id}"


def pool_control(worker: str, pid: int) -> str:
    """Pub/sub channel of one pool process, subscribed once: the signals and cancels of the shell
    calls it runs, each message naming its call (`task`)."""
    return f"{PREFIX}:ctl:pool:{worker}:{pid}"


def signals(task_id: str) -> str:
    """List of the signals clients sent, in order: a worker not yet listening (the call queued, or
    its sandbox still starting) reads them from here, so none is lost."""
    return f"{PREFIX}:signals:{task_id}"


def file_lock(tenant: str, run_id: str, path: str) -> str:
    """Lock serialising compare-and-swap on one file across worker processes and machines."""
    return f"{PREFIX}:lock:{tenant}:{run_id}:{path}"


def patch_intent(task_id: str) -> str:
    """String written before a file is replaced, so a redelivered patch recognises its own write;
    for a patch set, every staged file and its target, and the call's response, so the redelivered
    task or any worker can finish the renames (workers/patch_sets.py)."""
    return f"{PREFIX}:intent:{task_id}"


def rate(tenant: str, second: int) -> str:
    """Counter of one tenant's tool calls in one wall-clock second."""
    return f"{PREFIX}:rate:{tenant}:{second}"


def tenant_quotas(tenant: str) -> str:
    """Hash: the tenant's quota overrides (`runwarden tenant set`), name → limit; none expire."""
    return f"{PREFIX}:quotas:{tenant}"


def tenant_active(tenant: str) -> str:
    """Set of the tenant's task ids queued or running: its `max_running` quota counts them. Added by
    the claim, removed by whatever ends the call (finish, cancel, reap, release)."""
    return f"{PREFIX}:active:{tenant}"


def run_active(tenant: str, run_id: str) -> str:
    """Set of one run's task ids queued or running (a busy workspace cannot be deleted)."""
    return f"{PREFIX}:runactive:{tenant}:{run_id}"


def calls_per_minute(tenant: str, minute: int) -> str:
    """Counter of the calls a tenant was admitted for in one wall-clock minute."""
    return f"{PREFIX}:cpm:{tenant}:{minute}"


def output_bytes(tenant: str, hour: int) -> str:
    """Counter of the output bytes of a tenant's shell calls that ended in one wall-clock hour."""
    return f"{PREFIX}:obytes:{tenant}:{hour}"


def audit(tenant: str) -> str:
    """Stream: the tenant's audit trail, one entry per accepted call, written when it ends (the Lua
    scripts that end calls append it); capped with XADD MAXLEN ~ RUNWARDEN_AUDIT_MAXLEN, no TTL."""
    return f"{PREFIX}:audit:{tenant}"


# Fair scheduling (shared/scheduler.py). A kombu queue's Redis key is its name: a tenant's hold
# queue is `<queue>.hold.<tenant>`, a list of Celery messages no worker consumes.
HOLD_INFIX = ".hold."
CONCURRENCY = f"{PREFIX}:concurrency"  # hash: worker name → its pool processes


def inflight(queue: str) -> str:
    """Set of the task ids given to a Celery queue and not ended: at most the queue's capacity."""
    return f"{PREFIX}:inflight:{queue}"


def ring(queue: str) -> str:
    """List of the tenants with calls held for a queue, in the order they get their next turn."""
    return f"{PREFIX}:ring:{queue}"


def ring_members(queue: str) -> str:
    """Set mirroring the ring, for membership in O(1)."""
    return f"{PREFIX}:ringset:{queue}"


def ring_holders(queue: str) -> str:
    """Set of the tenants that held calls for a queue, for the heal to find forgotten messages."""
    return f"{PREFIX}:holders:{queue}"


def queue_workers(queue: str) -> str:
    """Sorted set: the workers consuming a queue, scored by when their heartbeat expires (ms)."""
    return f"{PREFIX}:workers:{queue}"


# Node placement (shared/placement.py).
NODES = f"{PREFIX}:nodes"  # sorted set: worker node → when its heartbeat expires (ms)
DRAINING = f"{PREFIX}:nodes:draining"  # set of nodes that take no new run (stopping)


def placement(tenant: str, run_id: str) -> str:
    """String: the node a run's workspace lives on (node placement); deleted with the workspace."""
    return f"{PREFIX}:placement:{tenant}:{run_id}"


def node_runs(node: str) -> str:
    """Set of the runs ("tenant/run") placed on a node: the fewest wins the next run."""
    return f"{PREFIX}:noderuns:{node}"


def revoked_jti(jti: str, tenant: str | None = None) -> str:
    """String present while a token id is revoked: for every tenant (`runwarden token revoke`), or
    for one tenant's tokens (`POST /v1/admin/revocations`, which acts on the admin's own tenant)."""
    return f"{PREFIX}:revoked:{jti}" if tenant is None else f"{PREFIX}:revoked:{tenant}:{jti}"


def stream_wake(instance: str, reader: str) -> str:
    """Stream (one entry, an hour's TTL): written to wake one of an API process's two stream readers
    (`api/fanout.py`, `reader` "hot" or "quiet") from its XREAD BLOCK, so that it reads again with
    the keys of streams opened meanwhile. Part of the reader's own XREAD, so a wake sent before
    the read reached Redis still ends it at once."""
    return f"{PREFIX}:wake:{instance}:{reader}"


REVOCATIONS = f"{PREFIX}:revocations"  # sorted set: revoked jti (or "tenant\0jti") → expiry, polled by streams


def mcp_request(tenant: str, run_id: str, sub: str, request_id: str) -> str:
    """String: the task id a running MCP `tools/call` started, found by who sent it (tenant, run, sub)
    and its JSON-RPC id (as JSON text, so 1 and "1" differ), so that a `notifications/cancelled`
    reaching a stateless server can cancel it. Set when the call is claimed; expires a minute after
    the longest the call may take."""
    who = hashlib.sha256(f"{run_id}\x00{sub}\x00{request_id}".encode()).hexdigest()
    return f"{PREFIX}:mcp:{tenant}:{who}"


def workspaces(tenant: str) -> str:
    """Hash: run_id → JSON {bytes, files, created} of each workspace of the tenant, written by
    workers (at creation, then measured again after calls); `GET /v1/workspaces` reads it. No TTL:
    an entry goes with its workspace."""
    return f"{PREFIX}:workspaces:{tenant}"


def workspace_lock(tenant: str, run_id: str) -> str:
    """String (an operation id) held by the worker creating, replacing or deleting the run's
    workspace; 60 s TTL, renewed while it works. Its staging directory is stale once it is gone."""
    return f"{PREFIX}:wslock:{tenant}:{run_id}"


def upload(op_id: str) -> str:
    """List of one upload's chunks, each tagged (data, end, abort), pushed by the API and popped by
    the worker extracting it; at most ~16 unread (the API waits); 60 s TTL, renewed by each push."""
    return f"{PREFIX}:upload:{op_id}"


def workspace_outcome(op_id: str) -> str:
    """List pushed once with a workspace operation's answer (JSON status and body) for the waiting
    API; 60 s TTL."""
    return f"{PREFIX}:wsdone:{op_id}"


# Sorted set of "tenant/run_id" scored by the workspace's last use (epoch seconds), written by
# workers after each call: idle expiry and re-measuring read it. No TTL: a member goes with its workspace.
WORKSPACES_BY_USE = f"{PREFIX}:wsused"
WORKSPACE_SWEEP_LOCK = f"{PREFIX}:wssweep"  # string with a TTL: one worker sweeps per interval
# Hash: `passes` (sweeps done, for tests and operators) and `measured_at` (epoch seconds of the
# last sweep's start: workspaces used since then are measured again).
WORKSPACE_SWEEPS = f"{PREFIX}:wssweeps"

RUNNING_SET = f"{PREFIX}:running"  # sorted set of task ids running, scored by start time, for the reaper
