"""The audit trail (contract section 12): one record per accepted call, in its tenant's Redis Stream.

Who asked (sub, jti) and what (tool, path or the command's first 256 characters, key) are written to
the task record by the claim; the record is appended by the Lua function every script that ends a
call shares (`shared.records`), so it is written once, in the same step as the outcome, whatever
ended the call: its worker, a cancel while it was queued, or the reaper (`lost`). Each stream is
capped (XADD MAXLEN ~ RUNWARDEN_AUDIT_MAXLEN), oldest records first out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis

from shared import keys

MAX_COMMAND = 256  # characters of a command the trail keeps
MAX_LIMIT = 10_000
DEFAULT_LIMIT = 1000


@dataclass(frozen=True)
class Audited:
    """What the claim writes to the task record for its audit record, besides the call itself."""

    sub: str
    subject: str  # the path, or the command's first MAX_COMMAND characters
    maxlen: int


# Lua: append the call's record to its tenant's audit stream; `task_key` holds what the claim wrote.
# A call claimed before the trail existed has no `audit` field and is not recorded.
AUDIT = """
local AUDITED = {'tenant', 'run_id', 'sub', 'jti', 'key', 'call_id', 'tool_name', 'subject', 'created_ms',
                 'started_ms'}
local function audit(task_key, task_id, outcome, now_ms, exit_code, error_code)
  local where = redis.call('HMGET', task_key, 'audit', 'audit_max')
  if not where[1] then return end
  local values = redis.call('HMGET', task_key, unpack(AUDITED))
  local entry = {'task_id', task_id, 'outcome', outcome, 'ended_ms', now_ms}
  for i, name in ipairs(AUDITED) do
    if values[i] and values[i] ~= '' then
      entry[#entry + 1] = name
      entry[#entry + 1] = values[i]
    end
  end
  if exit_code ~= '' then entry[#entry + 1] = 'exit_code'; entry[#entry + 1] = exit_code end
  if error_code ~= '' then entry[#entry + 1] = 'error'; entry[#entry + 1] = error_code end
  redis.call('XADD', where[1], 'MAXLEN', '~', where[2], '*', unpack(entry))
end
"""


def parse_since(text: str | None, now_ms: int) -> int:
    """`since` as milliseconds since the epoch: an ISO 8601 time (UTC unless it says otherwise), or
    a number of seconds before now (`86400`: the last day), as Kubernetes' sinceTime/sinceSeconds.
    Raises ValueError."""
    if text is None or text == "":
        return 0
    if text.isascii() and text.isdigit():
        return max(0, now_ms - int(text) * 1000)
    when = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0, int(when.timestamp() * 1000))


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def record(fields: dict[bytes, bytes]) -> dict[str, Any]:
    """One stream entry as the trail shows it."""
    f = {k.decode(): v.decode() for k, v in fields.items()}
    created, started, ended = _number(f.get("created_ms")), _number(f.get("started_ms")), int(f["ended_ms"])
    subject = "command" if f.get("tool_name") == "execute_shell_command" else "path"
    return {
        "time": _iso(ended), "tenant": f.get("tenant"), "run_id": f.get("run_id"), "sub": f.get("sub"),
        "jti": f.get("jti"), "task_id": f["task_id"], "call_id": f.get("call_id"), "tool": f.get("tool_name"),
        subject: f.get("subject"), "idempotency_key": f.get("key"), "outcome": f["outcome"],
        "exit_code": _number(f.get("exit_code")), "error": f.get("error"),
        "duration_ms": ended - created if created is not None else None,
        "queue_wait_ms": started - created if started is not None and created is not None else None,
    }


def read(client: redis.Redis, tenant: str, since_ms: int, limit: int) -> list[dict[str, Any]]:
    """The tenant's records that ended at or after `since_ms`, oldest first, at most `limit`."""
    entries = client.xrange(keys.audit(tenant), min=f"{since_ms}-0", max="+", count=limit)
    return [record(fields) for _, fields in entries]


def json_lines(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records)
