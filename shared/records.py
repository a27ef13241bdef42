"""The task record: one hash per call, moved between statuses only by the Lua scripts below.

Every transition that ends a call (finish, cancel of a queued call, reaping a lost one) is one script
that checks the call is not already terminal, so the first terminal status wins and a shell stream
gets exactly one `exit` event.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoScriptError

from shared import keys, metrics
from shared.audit import AUDIT
from shared.endings import ShellEnd, Termination
from shared.keys import Status
from shared.scheduler import DISPATCH, UNSENT_AFTER_MS
from shared.schema import TOOLS

KOMBU_UNACKED = "unacked"  # kombu's Redis transport keeps received, unacked messages here (its default)

LOCK_TTL_MS = 60_000  # a file lock a task holds; a dead worker's lock is taken over or expires

# A lock owned by a task: free, or already this task's (a redelivery takes over the lock its killed
# worker held) → taken, and the task's patch intent returned ('' if none); another task's → false.
# With the lock taken and no intent yet, a `proposed` intent (a patch computed before the lock) is
# recorded: a patch's intent is only ever written by the holder of its file's lock.
TAKE_LOCK = """
local function take_lock(lock_key, intent_key, owner, ttl_ms, proposed, intent_ttl_ms)
  if redis.call('SET', lock_key, owner, 'NX', 'PX', ttl_ms) or redis.call('GET', lock_key) == owner then
    redis.call('PEXPIRE', lock_key, ttl_ms)
    local earlier = redis.call('GET', intent_key)
    if not earlier and proposed and proposed ~= '' then
      redis.call('SET', intent_key, proposed, 'PX', intent_ttl_ms)
    end
    return earlier or ''
  end
  return false
end
"""

# KEYS: task, lease, running set; then, for a file task, optionally its file lock and its patch
# intent, and for a shell task its signal list.
# ARGV: worker, now ms, lease ms, task id, reentrant ("1" for file tasks), lock ttl ms, for a
# patch its proposed intent and the intent's ttl ms, and for a shell call the control channel its
# pool process listens on (recorded with `running`, so a signal or cancel after it reaches it).
# A call that may run also gets, in the same round trip, its lock if it names one (file), or the
# signals sent before it started (shell).
_START = TAKE_LOCK + """
local function may_run(state)
  if ARGV[5] ~= '1' then return {state, redis.call('LRANGE', KEYS[4], 0, -1)} end  -- shell: signals so far
  if KEYS[4] then return {state, take_lock(KEYS[4], KEYS[5], ARGV[4], ARGV[6], ARGV[7], ARGV[8])} end
  return {state}
end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
if status ~= 'queued' and not (ARGV[5] == '1' and status == 'running') then
  -- A shell call runs at most once: a second delivery of one started already does not run it.
  if status == 'running' then return {'started already'} end
  return {status}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_ms', ARGV[2], 'worker', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
if ARGV[5] ~= '1' then
  -- Only shell calls hold a lease: a file call is re-delivered instead, and its write guarded.
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
  if ARGV[9] and ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'control', ARGV[9]) end
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[4])
end
if redis.call('HGET', KEYS[1], 'cancel') then return may_run('cancel') end
local created = redis.call('HGET', KEYS[1], 'created_ms') or ''  -- for the queue wait's metric
return may_run('running:' .. redis.call('HGET', KEYS[1], 'attempts') .. ':' .. created)
"""

# Lua: tell the worker running call `id` (task hash `task_key`) of `order`: on the channel its
# start recorded, else the call's own (an older worker's).
_TELL = """
local function tell(task_key, id, fallback, order)
  order['task'] = id
  redis.call('PUBLISH', redis.call('HGET', task_key, 'control') or fallback, cjson.encode(order))
end
"""

# KEYS: the call's signal list, its task. ARGV: signal name, the call's own channel, retention ms, task id.
_SIGNAL = _TELL + """
local n = redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
tell(KEYS[2], ARGV[4], ARGV[2], {signal = ARGV[1], n = n})
return n
"""

# A patch set's commit (workers/patch_sets.py). KEYS: the set's intent, its lease, then its locks.
# ARGV: owner (task id), intent, intent ttl ms, actor, lease ms. Only while every lock is still the
# set's: the locks last as long as the intent (until the set is finished, no other writer gets in),
# the intent is recorded, and the actor that will do the renames takes the lease.
COMMIT_SET = """
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) ~= ARGV[1] then return 0 end
end
for i = 3, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
return 1
"""

# KEYS: a set's lease, its task. ARGV: actor, lease ms. Renewed by the actor holding it, or taken
# back by it if it lapsed meanwhile (a slow step, a pause) and no one took it over: 1. 0 if another
# actor has it, or the call has ended (another actor finished it and its locks are free again).
RENEW_LEASE = """
if redis.call('HGET', KEYS[2], 'status') ~= 'running' then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: a set's intent, its lease. ARGV: actor, lease ms. A committed set whose actor stopped
# renewing its lease is taken over (by its redelivered task, or a worker waiting for its locks).
TAKE_OVER_SET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# KEYS: locks. ARGV: owner, ttl ms. Those still the owner's last another ttl; returns how many.
RENEW_LOCKS = """
local mine = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    mine = mine + 1
  end
end
return mine
"""

# Shared tail of every terminal transition. Expects `status` (new), `result`, `code`, `body`, `exit`,
# and for the audit record the exit code and error code ('' for none). Returns what the metrics of a
# call's end need and what its worker does next: {tool name, created ms, the run's other calls}.
_END = DISPATCH + AUDIT + """
local function finish(task_key, lease_key, running_key, log_key, done_key, task_id, new_status, result,
                      now_ms, ttl_ms, code, body, exit_event, retention_ms, exit_code, error_code)
  local idem = redis.call('HGET', task_key, 'idem')
  redis.call('HSET', task_key, 'status', new_status, 'result', result, 'finished_ms', now_ms)
  audit(task_key, task_id, new_status, now_ms, exit_code, error_code)
  local sets = redis.call('HMGET', task_key, 'active', 'run_active')
  for _, set in ipairs(sets) do
    if set then redis.call('SREM', set, task_id) end  -- the tenant's and run's slots come back
  end
  local run_busy = 0  -- the run's other calls, queued or running
  if sets[2] then run_busy = redis.call('SCARD', sets[2]) end
  ended(task_key, task_id, tonumber(now_ms))  -- and its queue's: the next call in turn starts
  if code ~= '' then redis.call('HSET', task_key, 'code', code, 'body', body) end
  redis.call('PEXPIRE', task_key, ttl_ms)
  if idem then
    redis.call('HSET', idem, 'state', 'done')
    if code ~= '' then redis.call('HSET', idem, 'code', code, 'body', body) end
    redis.call('PEXPIRE', idem, ttl_ms)
  end
  redis.call('DEL', lease_key)
  redis.call('ZREM', running_key, task_id)
  -- What the waiting API answers with rides along, so it needs no second round trip: a file call's
  -- response, or a shell call's status and result if small (no one may pop it: it expires).
  local signal = ''
  if code ~= '' then signal = code .. ' ' .. body
  elseif string.len(result) <= 65536 then signal = new_status .. ' ' .. result end
  redis.call('RPUSH', done_key, signal)
  redis.call('PEXPIRE', done_key, 60000)
  if exit_event ~= '' then
    local seq = 1
    local last = redis.call('XREVRANGE', log_key, '+', '-', 'COUNT', 1)
    if last[1] then seq = tonumber(string.match(last[1][1], '^(%d+)')) + 1 end
    local event = string.gsub(exit_event, '"seq":0', '"seq":' .. seq, 1)
    redis.call('XADD', log_key, seq .. '-1', 'e', event)
    redis.call('PEXPIRE', log_key, retention_ms)
  end
  local reply = redis.call('HMGET', task_key, 'tool_name', 'created_ms')
  reply[3] = run_busy
  return reply
end
local function terminal(status)
  return status == 'completed' or status == 'failed' or status == 'cancelled' or status == 'lost'
end
"""

# KEYS: task, lease, running set, log, done, then the locks the task may own (its patched files').
# ARGV: task id, status, result, now, ttl, code, body, exit event, retention, exit code, error code.
_FINISH = _END + """
for i = 6, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
local status = redis.call('HGET', KEYS[1], 'status')
if not status or terminal(status) then return 0 end
return finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5],
              ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
"""

# KEYS: task, lease, running set, log, done.
# ARGV: task id, result, now, ttl, exit event, retention, response code, response body, the call's
# own control channel. A queued call is cancelled at once; a running one is flagged and its worker told.
_CANCEL = _END + _TELL + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status == 'queued' then
  local ended = finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'cancelled', ARGV[2], ARGV[3],
                       ARGV[4], ARGV[7], ARGV[8], ARGV[5], ARGV[6], '', 'cancelled')
  return {'cancelled', ended[1], ended[2]}
end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  tell(KEYS[1], ARGV[1], ARGV[9], {cancel = true})
end
return status
"""

# KEYS: task, lease, running set, log, done. ARGV: task id, result, now, ttl, exit event, retention.
_REAP = _END + """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
return finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'lost', ARGV[2], ARGV[3], ARGV[4], '', '',
              ARGV[5], ARGV[6], '', 'worker_lost')
"""


# KEYS: task, lease, running set, log, done. ARGV: task id, result, now, ttl, exit event, retention,
# response code, response body, dispatched before (ms), kombu's unacked hash.
# A queued call given to its Celery queue long ago whose message is in neither that queue nor
# kombu's unacked set: a crash between the broker's pop and its ack lost it (kombu's Redis transport
# pops, then records the message as unacked). It will never start, so it ends `lost`; should its
# message turn up after all, its worker finds it ended and does not run it. (runwarden sends every
# call at kombu's default priority, so its message is in the queue's own list.)
_LOSE_UNSENT = _END + """
local status, since, queue = unpack(redis.call('HMGET', KEYS[1], 'status', 'dispatched_ms', 'queue'))
if status ~= 'queued' or not since or not queue or tonumber(since) > tonumber(ARGV[9]) then return 0 end
local function holds(messages)
  for _, message in ipairs(messages) do
    if string.find(message, ARGV[1], 1, true) then return true end
  end
  return false
end
if holds(redis.call('LRANGE', queue, 0, -1)) or holds(redis.call('HVALS', ARGV[10])) then return 0 end
return finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'lost', ARGV[2], ARGV[3], ARGV[4], ARGV[7],
              ARGV[8], ARGV[5], ARGV[6], '', 'message_lost')
"""


def overlapped(client: redis.Redis, command: tuple[Any, ...], meanwhile: Callable[[], None],
               again: Callable[[], Any]) -> Any:
    """`command`'s reply, its round trip overlapping `meanwhile`: the command is sent, `meanwhile`
    runs, then the reply is read. On connection trouble, or a script Redis has not loaded (a
    NOSCRIPT reply), `again` runs it the usual way, with the client's retries and script loading.
    Only for commands that may run twice. A reply never read is never left for the connection's
    next user: that connection is dropped."""
    pool = client.connection_pool
    connection = pool.get_connection()
    unread, reply = False, _NO_REPLY
    try:
        with suppress(redis.ConnectionError):
            connection.send_command(*command)
            unread = True
        meanwhile()
        if unread:
            with suppress(redis.ConnectionError, NoScriptError):
                unread = False
                try:
                    reply = connection.read_response()
                except redis.ConnectionError:
                    connection.disconnect()
                    raise
    finally:
        if unread:
            connection.disconnect()
        pool.release(connection)
    return again() if reply is _NO_REPLY else reply


_NO_REPLY = object()


def _counted(reply: Any, outcome: str, ended_ms: int) -> bool:
    """Whether a script ended the call (its reply is then [tool name, created ms, …]); if it did, the
    end is counted in this process's metrics, once."""
    if not isinstance(reply, list):
        return False
    tool, created = (part.decode() if part else "" for part in reply[:2])
    metrics.call_ended(tool, outcome, int(created) if created.isdigit() else None, ended_ms)
    return True


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class TaskView:
    task_id: str
    tenant: str
    run_id: str
    call_id: str
    tool_name: str
    status: Status
    result: Any
    cancel_requested: bool

    def public(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "call_id": self.call_id,
            "tool_name": self.tool_name,
            "status": self.status.value,
            "result": self.result,
        }


@dataclass(frozen=True)
class Ended:
    """What a call's done signal carried: a file call's recorded response, or a shell call's status
    and result (when small); with neither, the task record has them."""

    response: tuple[int, bytes] | None = None
    status: Status | None = None
    result: Any = None

    @classmethod
    def parse(cls, signal: bytes) -> Ended:
        head, _, rest = signal.partition(b" ")
        if head.isdigit():
            return cls(response=(int(head), rest))
        if head:
            return cls(status=Status(head.decode()), result=json.loads(rest))
        return cls()


@dataclass(frozen=True)
class Started:
    """What starting a call found: `status` is "running" (with the deliveries so far), "cancel" if a
    cancel was flagged, or the status it may not start from. `intent` is set only when the lock
    named was taken: the task's earlier patch intent, b"" if none."""

    status: str
    attempts: int = 0
    intent: bytes | None = None
    signals: tuple[str, ...] = ()  # a shell call's: the signals clients sent before it started
    started_ms: int = 0
    created_ms: int | None = None  # when the call was accepted (running only)

    @property
    def queue_wait_s(self) -> float | None:
        """From the call's acceptance to this start (the first delivery's), if it started."""
        if self.status != "running" or self.attempts != 1 or self.created_ms is None:
            return None
        return max(0, self.started_ms - self.created_ms) / 1000


class Records:
    def __init__(self, client: redis.Redis, *, ttl_s: int, retention_s: int, lease_s: int) -> None:
        self.client = client
        self.ttl_ms = ttl_s * 1000
        self.retention_ms = retention_s * 1000
        self.lease_ms = lease_s * 1000
        self._start = client.register_script(_START)
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)
        self._signal = client.register_script(_SIGNAL)
        self._reap = client.register_script(_REAP)
        self._lose_unsent = client.register_script(_LOSE_UNSENT)

    def _keys(self, task_id: str) -> list[str]:
        return [keys.task(task_id), keys.lease(task_id), keys.RUNNING_SET, keys.log(task_id), keys.done(task_id)]

    def get(self, task_id: str) -> TaskView | None:
        fields = self.client.hgetall(keys.task(task_id))
        if not fields or b"status" not in fields:
            return None
        text = {k.decode(): v.decode() for k, v in fields.items()}
        return TaskView(
            task_id=task_id,
            tenant=text["tenant"],
            run_id=text["run_id"],
            call_id=text["call_id"],
            tool_name=text["tool_name"],
            status=Status(text["status"]),
            result=json.loads(text["result"]) if "result" in text else None,
            cancel_requested="cancel" in text,
        )

    def start(self, task_id: str, worker: str, *, reentrant: bool = False, lock: str | None = None,
              proposed: bytes = b"", meanwhile: Callable[[], None] | None = None, control: str = "") -> Started:
        """queued → running (or, reentrant, running again), taking the file lock `lock` if named and
        recording the `proposed` patch intent with it (see TAKE_LOCK). `meanwhile` runs while the
        reply is on its way. `control`: the channel a shell call's pool process listens on."""
        if reentrant:  # a file call, with its lock if it names one
            extra = [lock, keys.patch_intent(task_id)] if lock else []
        else:  # a shell call, with the signals sent before it started
            extra = [keys.signals(task_id)]
        script_keys = self._keys(task_id)[:3] + extra
        started_ms = now_ms()
        args = [worker, started_ms, self.lease_ms, task_id, "1" if reentrant else "0", LOCK_TTL_MS, proposed,
                self.ttl_ms, control]
        if meanwhile is None:
            reply = self._start(keys=script_keys, args=args)
        else:
            reply = overlapped(self.client, ("EVALSHA", self._start.sha, len(script_keys), *script_keys, *args),  # type: ignore[attr-defined]
                               meanwhile, lambda: self._start(keys=script_keys, args=args))
        status, _, rest = reply[0].decode().partition(":")
        attempts, _, created = rest.partition(":")
        found = reply[1] if len(reply) > 1 else None
        created_ms = int(created) if created.isdigit() else None
        if reentrant:
            return Started(status, int(attempts or 0), intent=found, started_ms=started_ms, created_ms=created_ms)
        return Started(status, int(attempts or 0), signals=tuple(name.decode() for name in found or ()),
                       started_ms=started_ms, created_ms=created_ms)

    def send_signal(self, task_id: str, name: str) -> None:
        """Keep the signal for a worker not yet listening, and tell one that is (with the signal's
        place in the list, so a worker that already read it from there does not send it twice)."""
        self._signal(keys=[keys.signals(task_id), keys.task(task_id)],
                     args=[name, keys.control(task_id), self.retention_ms, task_id])

    def refresh_lease(self, task_id: str, worker: str) -> None:
        self.client.set(keys.lease(task_id), worker, px=self.lease_ms)

    def finish(
        self,
        task_id: str,
        status: Status,
        result: Any,
        *,
        response: tuple[int, bytes] | None = None,
        exit_json: str = "",
        release: str | Sequence[str] | None = None,
    ) -> int | None:
        """Record the terminal status (first one wins), complete the idempotency record, append the
        audit record, and free the locks `release` names that this task holds (a patch's file, a patch
        set's files). None if the call had ended already; else how many other calls of its run are
        queued or running (a worker prepares a run's next sandbox only when none are)."""
        code, body = response if response else ("", b"")
        exit_code = result.get("exit_code") if isinstance(result, dict) else None
        error_code = result.get("code") if isinstance(result, dict) and status is not Status.COMPLETED else None
        ended_ms = now_ms()
        reply = self._finish(
            keys=self._keys(task_id) + ([release] if isinstance(release, str) else list(release or ())),
            args=[task_id, status.value, json.dumps(result), ended_ms, self.ttl_ms, code, body, exit_json,
                  self.retention_ms, "" if exit_code is None else int(exit_code), error_code or ""],
        )
        if not _counted(reply, status.value, ended_ms):
            return None
        return int(reply[2])

    def cancel(self, view: TaskView) -> str:
        """Cancel a queued call at once (a shell stream gets its exit event; a file call's retry
        replays the cancelled record), or flag a running one and tell its worker (which ends it:
        SIGTERM, then SIGKILL); returns the status found."""
        ended_ms = now_ms()
        found = self._cancel(
            keys=self._keys(view.task_id),
            args=[*self._never_ran(view, Status.CANCELLED, Termination.CANCELLED, ended_ms,
                                   "cancelled", "Cancelled before it started."), keys.control(view.task_id)],
        )
        if isinstance(found, list):  # this cancel ended the queued call
            _counted(found[1:], Status.CANCELLED.value, ended_ms)
            return Status.CANCELLED.value
        return found.decode()

    def reap(self, task_id: str) -> bool:
        """A running shell call whose worker stopped renewing its lease becomes `lost` (never re-run);
        only shell calls hold leases."""
        end = ShellEnd(Termination.LOST)
        result = {"code": "worker_lost", "message": "The worker running this call stopped; it was not re-run.",
                  **end.never_ran_fields()}
        exit_json = end.exit_event(Status.LOST)
        ended_ms = now_ms()
        reply = self._reap(
            keys=self._keys(task_id),
            args=[task_id, json.dumps(result), ended_ms, self.ttl_ms, exit_json, self.retention_ms],
        )
        return _counted(reply, Status.LOST.value, ended_ms)

    def lose_unsent_calls(self, queues: Sequence[str]) -> int:
        """End as `lost` the calls given to these queues whose messages a crash lost."""
        before_ms = now_ms() - UNSENT_AFTER_MS
        ids = {member.decode() for queue in queues for member in self.client.smembers(keys.inflight(queue))}
        return sum(self.lose_unsent(task_id, before_ms) for task_id in sorted(ids))

    def lose_unsent(self, task_id: str, dispatched_before_ms: int) -> bool:
        """A queued call given to its queue before `dispatched_before_ms` whose message a crash lost
        (see _LOSE_UNSENT) becomes `lost`: it never ran and never will."""
        view = self.get(task_id)
        if view is None or view.status is not Status.QUEUED:
            return False
        ended_ms = now_ms()
        ending = self._never_ran(view, Status.LOST, Termination.LOST, ended_ms, "message_lost",
                                 "The call's message was lost in a broker restart; it never ran.")
        reply = self._lose_unsent(keys=self._keys(task_id), args=[*ending, dispatched_before_ms, KOMBU_UNACKED])
        return _counted(reply, Status.LOST.value, ended_ms)

    def _never_ran(self, view: TaskView, status: Status, termination: Termination, ended_ms: int, code: str,
                   message: str) -> list[Any]:
        """ARGV 1–8 of a script that ends a queued call: task id, result, now, ttl, the exit event a
        shell call's stream gets, retention, and the response a file call's retry replays."""
        shell = TOOLS[view.tool_name].streams
        end = ShellEnd(termination)
        result = {"code": code, "message": message, **(end.never_ran_fields() if shell else {})}
        exit_json = end.exit_event(status) if shell else ""
        body = "" if shell else json.dumps({**view.public(), "status": status.value, "result": result},
                                           ensure_ascii=False, separators=(",", ":"))
        return [view.task_id, json.dumps(result), ended_ms, self.ttl_ms, exit_json, self.retention_ms,
                "" if shell else 200, body]

    def response(self, task_id: str) -> tuple[int, bytes] | None:
        """The HTTP response a worker recorded for the call (file tools), if it has ended."""
        code, body = self.client.hmget(keys.task(task_id), "code", "body")
        return (int(code), body or b"") if code is not None else None

    def wait_done(self, task_id: str, timeout_s: float) -> Ended | None:
        """Block until the call has ended (None at the timeout); in short BLPOPs, below socket timeouts."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            popped = self.client.blpop([keys.done(task_id)], timeout=max(0.01, min(left, 5.0)))
            if popped is not None:
                return Ended.parse(popped[1])
        return None

    def running_since(self, older_than_ms: int) -> list[str]:
        return [t.decode() for t in self.client.zrangebyscore(keys.RUNNING_SET, 0, older_than_ms)]
