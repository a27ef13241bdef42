"""Workspaces as a resource (contract section 11): what the API and the workers both need.

The API never touches the workspaces' disk: every operation is a Celery task run by a worker, and
an upload's bytes reach that worker through Redis. The API pushes the request body in tagged
chunks onto the upload's list while it reads it (at most WINDOW_CHUNKS unread: it waits for the
worker), then an end tag; the worker pops them as it extracts and answers on the operation's
outcome list, which the API waits on. Every workspace is recorded in Redis (`Registry`), so
`GET /v1/workspaces` answers without a disk.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import redis
from jsonschema import Draft202012Validator

from shared import keys
from shared.placement import node_queue
from shared.errors import SchemaInvalid
from shared.schema import whole

SCOPE = "workspaces:admin"
CREATE_TASK = "runwarden.workspace_create"
DELETE_TASK = "runwarden.workspace_delete"

CHUNK_BYTES = 256 * 1024
WINDOW_CHUNKS = 16  # unread chunks an upload may have in Redis before the API waits for the worker
UPLOAD_TTL_MS = 60_000
OUTCOME_TTL_MS = 60_000
DATA, END, ABORT = b"D", b"E", b"A"  # the tag that starts each item of an upload's list
POLL_S = 0.01


def queue_for(node: str | None) -> str:
    """The queue a run's workspace operations go to: the shared files queue, or under node
    placement (contract section 14) its node's."""
    return keys.FILE_QUEUE if node is None else node_queue(keys.FILE_QUEUE, node)


def member(tenant: str, run_id: str) -> str:
    """A workspace's name in WORKSPACES_BY_USE ("/" is in neither name)."""
    return f"{tenant}/{run_id}"


def upload_body_limit(quota_bytes: int, max_files: int) -> int | None:
    """The largest body an archive within the quota can need: its files' bytes, a header and
    padding per entry (under 1.5 KiB), gzip's overhead on incompressible data (under 1/64) and
    1 MiB for the archive's end. None when the quota is 0 (unlimited)."""
    if quota_bytes == 0:
        return None
    return quota_bytes + quota_bytes // 64 + max_files * 1536 + (1 << 20)


def iso8601(epoch_s: float) -> str:
    return datetime.fromtimestamp(int(epoch_s), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- a git source: {"git": {"url": …, "ref": …}} ----

GIT_SCHEMES = ("https", "http", "git")
GIT_SOURCE_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["git"],
    "properties": {"git": {
        "type": "object", "additionalProperties": False, "required": ["url"],
        "properties": {
            # No credentials (`@`), query, fragment, backslash or space; the host is checked in code.
            "url": {"type": "string", "minLength": 8, "maxLength": 2048,
                    "pattern": whole("(?:https?|git)://[A-Za-z0-9\\[][^\\s@?#\\\\]*"),
                    "description": "https://, http:// or git:// URL of the repository, without credentials."},
            "ref": {"type": "string", "minLength": 1, "maxLength": 255,
                    "pattern": whole("[A-Za-z0-9_][A-Za-z0-9._/-]*"),
                    "description": "Branch or tag to clone (default: the remote's HEAD)."},
        },
    }},
}
_GIT_VALIDATOR = Draft202012Validator(GIT_SOURCE_SCHEMA)


@dataclass(frozen=True)
class GitSource:
    url: str
    ref: str | None

    @property
    def scheme(self) -> str:
        return self.url.partition(":")[0]


def parse_git_source(body: Any) -> GitSource:
    """The clone a JSON body asks for, validated strictly; SchemaInvalid with pointers otherwise."""
    errors = [{"pointer": "".join(f"/{part}" for part in error.absolute_path), "message": error.message[:300]}
              for error in _GIT_VALIDATOR.iter_errors(body)]
    if not errors:
        url, ref = body["git"]["url"], body["git"].get("ref")
        if not _host_ok(url):
            errors.append({"pointer": "/git/url", "message": "not a URL with a host name or address"})
        if ref is not None and not _ref_ok(ref):
            errors.append({"pointer": "/git/ref", "message": "not a branch or tag name git accepts"})
    if errors:
        raise SchemaInvalid("The body must be {\"git\": {\"url\": …, \"ref\": …}}.", errors=errors)
    return GitSource(body["git"]["url"], body["git"].get("ref"))


def _host_ok(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return False
    host = parts.hostname or ""
    named = all(ch.isalnum() or ch in ".-" for ch in host) and not host.startswith(("-", "."))
    return (parts.scheme in GIT_SCHEMES and host.isascii() and (named or ":" in host)
            and parts.path not in ("", "/"))


def _ref_ok(ref: str) -> bool:
    """git check-ref-format's rules that the schema's pattern leaves out."""
    return ".." not in ref and all(segment and not segment.startswith(".") and not segment.endswith((".", ".lock"))
                                   for segment in ref.split("/"))


# ---- the record of every workspace ----

@dataclass(frozen=True)
class Usage:
    files: int  # entries of every kind below the workspace's root: files, directories, links
    total_bytes: int  # of its regular files


# KEYS: the tenant's workspaces hash. ARGV: run id, bytes, files.
# A measurement updates an entry that still exists; it never brings back a deleted workspace.
_MEASURED = """
local found = redis.call('HGET', KEYS[1], ARGV[1])
if not found then return 0 end
local entry = cjson.decode(found)
entry['bytes'] = tonumber(ARGV[2])
entry['files'] = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(entry))
return 1
"""


class Registry:
    """Redis's record of the workspaces: per tenant, run_id → {bytes, files, created}; and when
    each was last used (WORKSPACES_BY_USE). Written by workers only; read by the API."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._measured = client.register_script(_MEASURED)

    def created(self, tenant: str, run_id: str, usage: Usage) -> None:
        now = time.time()
        entry = json.dumps({"bytes": usage.total_bytes, "files": usage.files, "created": int(now)})
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(keys.workspaces(tenant), run_id, entry)
        pipe.zadd(keys.WORKSPACES_BY_USE, {member(tenant, run_id): now})
        pipe.execute()

    def used(self, tenant: str, run_id: str) -> None:
        """A call of the run ended: its last use is now; a workspace its first call made is recorded
        (measured by the next sweep)."""
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.hsetnx(keys.workspaces(tenant), run_id, json.dumps({"bytes": 0, "files": 0, "created": int(now)}))
        pipe.zadd(keys.WORKSPACES_BY_USE, {member(tenant, run_id): now})
        pipe.execute()

    def adopted(self, tenant: str, run_id: str, usage: Usage, last_used: float) -> None:
        """A workspace found on disk but not recorded (made before this record existed)."""
        entry = json.dumps({"bytes": usage.total_bytes, "files": usage.files, "created": int(last_used)})
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(keys.workspaces(tenant), run_id, entry)
        pipe.zadd(keys.WORKSPACES_BY_USE, {member(tenant, run_id): int(last_used)}, nx=True)
        pipe.execute()

    def measured(self, tenant: str, run_id: str, usage: Usage) -> None:
        self._measured(keys=[keys.workspaces(tenant)], args=[run_id, usage.total_bytes, usage.files])

    def remove(self, tenant: str, run_id: str) -> bool:
        """Forget the workspace; whether it was recorded."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(keys.workspaces(tenant), run_id)
        pipe.zrem(keys.WORKSPACES_BY_USE, member(tenant, run_id))
        return bool(pipe.execute()[0])

    def exists(self, tenant: str, run_id: str) -> bool:
        return bool(self.client.hexists(keys.workspaces(tenant), run_id))

    def listing(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's workspaces, by run_id, as `GET /v1/workspaces` shows them."""
        entries = sorted(self.client.hgetall(keys.workspaces(tenant)).items())
        if not entries:
            return []
        runs = [run_id.decode() for run_id, _ in entries]
        scores = self.client.zmscore(keys.WORKSPACES_BY_USE, [member(tenant, run_id) for run_id in runs])
        listed = []
        for run_id, (_, raw), score in zip(runs, entries, scores):
            entry = json.loads(raw)
            listed.append({"run_id": run_id, "bytes": entry["bytes"], "files": entry["files"],
                           "created": iso8601(entry["created"]),
                           "last_used": iso8601(score if score is not None else entry["created"]),
                           "node": None})
        return listed

    def last_used(self, tenant: str, run_id: str) -> float | None:
        return self.client.zscore(keys.WORKSPACES_BY_USE, member(tenant, run_id))


# ---- one operation's exchange: the upload's chunks one way, the outcome the other ----

# KEYS: upload list, outcome list. ARGV: item, ttl ms.
# The list's length after the push, or -1 once the worker has answered (it reads no more).
_PUSH = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local n = redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return n
"""


class Operation:
    """The Redis side of one workspace operation (`op_id` is also its Celery task id)."""

    def __init__(self, client: redis.Redis, op_id: str) -> None:
        self.client = client
        self.op_id = op_id
        self.upload_key = keys.upload(op_id)
        self.outcome_key = keys.workspace_outcome(op_id)
        self._push = client.register_script(_PUSH)

    def push(self, item: bytes) -> int:
        """Append a tagged item; the number unread, or -1 if the worker has answered."""
        return int(self._push(keys=[self.upload_key, self.outcome_key], args=[item, UPLOAD_TTL_MS]))

    def wait_for_room(self, deadline: float) -> bool:
        """Wait until the worker has read the window down to half; False if it answered meanwhile.
        Polled: the worker reads at disk speed, so the wait is short and rare."""
        while time.monotonic() < deadline:
            pipe = self.client.pipeline(transaction=False)
            pipe.llen(self.upload_key)
            pipe.exists(self.outcome_key)
            unread, answered = pipe.execute()
            if answered:
                return False
            if unread <= WINDOW_CHUNKS // 2:
                return True
            time.sleep(POLL_S)
        raise TimeoutError

    def pop(self, timeout_s: float) -> bytes | None:
        """The next item, or None after `timeout_s` (in short waits, below socket timeouts)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            popped = self.client.blpop([self.upload_key], timeout=max(0.01, min(left, 5.0)))
            if popped is not None:
                return popped[1]
        return None

    def answer(self, status: int, body: dict[str, Any] | None) -> None:
        """Record the outcome once, and drop what is left of the upload."""
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(self.outcome_key, json.dumps({"status": status, "body": body}))
        pipe.pexpire(self.outcome_key, OUTCOME_TTL_MS)
        pipe.delete(self.upload_key)
        pipe.execute()

    def wait_answer(self, deadline: float) -> tuple[int, dict[str, Any] | None] | None:
        """The worker's (status, body), or None at the deadline (monotonic)."""
        while (left := deadline - time.monotonic()) > 0:
            popped = self.client.blpop([self.outcome_key], timeout=max(0.01, min(left, 5.0)))
            if popped is not None:
                outcome = json.loads(popped[1])
                return outcome["status"], outcome["body"]
        return None

    def abort(self) -> None:
        """Tell the worker the upload will not be completed (the client stalled or went away)."""
        self.push(ABORT)
