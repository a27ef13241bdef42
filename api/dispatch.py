"""The path every surface takes from a validated call to its outcome, in one place.

authorize → fingerprint → claim → enqueue, then the surface's answer: REST at once or after
`Prefer: wait` (`submit`); the model-native formats and MCP once the call has ended (`run_to_end`).
Quotas, fair scheduling and audit hook in here (before `claim`), so every call passes them alike.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from flask import Response, request
from kombu.exceptions import OperationalError
from redis import RedisError

from api import metrics
from api.problems import PROBLEM_JSON, json_response, problem_response
from api.runtime import Runtime, runtime
from shared import audit, commands, paths
from shared.errors import (IdempotencyKeyInUse, IdempotencyKeyReused, PathForbidden, QuotaExceeded, RateLimited,
                           SchemaInvalid, Unavailable)
from shared.audit import Audited
from shared.idempotency import Admitted, Existing, fingerprint
from shared.scheduler import hold_queue
from shared.keys import Status
from shared.records import Ended, TaskView
from shared.schema import ToolCall
from shared.tokens import Grant

log = logging.getLogger("runwarden.calls")
MAX_PREFER_WAIT_S = 60
POLL_S = 0.05


@dataclass(frozen=True)
class Accepted:
    """A call that passed every check: what the worker gets, and who asked."""

    call: ToolCall
    grant: Grant
    key: str
    task_id: str

    def message(self) -> dict[str, Any]:
        return {
            "tenant": self.grant.tenant, "run_id": self.grant.run_id, "sub": self.grant.sub, "idem_key": self.key,
            "call_id": self.call.call_id, "tool_name": self.call.tool_name,
            "parameters": self.call.parameters, "network": "shell:network" in self.grant.scopes,
            # A shell call's worker prepares the run's next sandbox for no longer than this token
            # is good for: its exp, and its jti should it be revoked (workers/sandbox/keeper.py).
            **({"allowed_paths": list(self.grant.allowed_paths), "exp": self.grant.exp, "jti": self.grant.jti}
               if self.call.tool.streams else {}),
        }

    def audit_subject(self) -> str:
        """What the audit trail names of the call: its path, or its command's first characters."""
        params = self.call.parameters
        if "path" in params:
            return str(params["path"])
        if "command" in params:
            return str(params["command"])[:audit.MAX_COMMAND]
        return ",".join(str(patch.get("path", "")) for patch in params.get("patches", ()))[:audit.MAX_COMMAND]

    def summary(self) -> str:
        """What task events (Flower, `celery events`) show of the call, as Celery's argsrepr: whose
        call and what it names, never its diff or command, which may hold a tenant's secrets. Also
        spares Celery's saferepr of the whole message on every send."""
        shown: dict[str, object] = {"tenant": self.grant.tenant, "run_id": self.grant.run_id,
                                    "call_id": self.call.call_id, "tool_name": self.call.tool_name}
        if "path" in self.call.parameters:
            shown["path"] = self.call.parameters["path"]
        if "patches" in self.call.parameters:
            shown["paths"] = [entry["path"] for entry in self.call.parameters["patches"]]
        return repr([shown])


def authorize(call: ToolCall, grant: Grant) -> ToolCall:
    """Scope, paths and programs; returns the call with its paths normalized."""
    grant.require_scope(call.tool.scope)
    params = dict(call.parameters)
    if "path" in params:
        params["path"] = paths.normalize(params["path"])
        grant.require_path(params["path"])
    if "patches" in params:
        params["patches"] = _authorize_patches(params["patches"], grant)
    if call.tool.streams:
        if "cwd" in params:
            params["cwd"] = paths.normalize(params["cwd"], allow_root=True)
            if params["cwd"] and not paths.path_allowed(grant.allowed_paths, params["cwd"]):
                raise PathForbidden("The token's allowed_paths do not cover this cwd.")
        if grant.allowed_commands is not None:
            commands.check(params["command"], grant.allowed_commands)
    return ToolCall(call.tool_name, call.call_id, params)


def _authorize_patches(patches: list[dict[str, Any]], grant: Grant) -> list[dict[str, Any]]:
    """Each entry's path normalized and granted, and none twice (after normalizing: `a//b` is
    `a/b`); a refusal names the entry by `failed_index`, as the worker's do."""
    normalized, first_at = [], dict[str, int]()
    for index, entry in enumerate(patches):
        try:
            path = paths.normalize(entry["path"])
            grant.require_path(path)
        except PathForbidden as exc:
            exc.extra["failed_index"] = index
            raise
        if path in first_at:
            pointer = f"/parameters/patches/{index}/path"
            raise SchemaInvalid("A patch set names each path once.", failed_index=index, errors=[
                {"pointer": pointer, "message": f"the same file as entry {first_at[path]}"}])
        first_at[path] = index
        normalized.append({**entry, "path": path})
    return normalized


def stream_url(task_id: str) -> str:
    """On RUNWARDEN_PUBLIC_URL when set; else on the request's own scheme and Host (what a proxy
    says of them only when RUNWARDEN_TRUSTED_PROXIES lets ProxyFix believe it)."""
    public_url = runtime().settings.public_url  # http(s)://…, checked at start
    if public_url:
        base = f"ws{public_url[4:]}"  # http… → ws…, https… → wss…
    else:
        base = f"{'wss' if request.scheme == 'https' else 'ws'}://{request.host}{request.root_path}"
    return f"{base}/v1/tool-calls/{task_id}/stream"


def prefer_wait() -> int | None:
    """Seconds from `Prefer: wait=N` (RFC 7240), capped at 60; None when absent or malformed."""
    for value in request.headers.getlist("Prefer"):
        for preference in value.split(","):
            name, _, number = preference.strip().partition("=")
            number = number.strip()
            if name.strip().lower() == "wait" and number.isascii() and number.isdigit():  # not "²": int() refuses it
                return min(int(number), MAX_PREFER_WAIT_S)
    return None


def accepted_body(accepted: Accepted) -> bytes | None:
    """A shell call's 202 answer, recorded with the claim (a retry while it runs gets its stream_url)."""
    if not accepted.call.tool.streams:
        return None
    ids = {"task_id": accepted.task_id, "call_id": accepted.call.call_id, "tool_name": accepted.call.tool_name}
    return json.dumps({**ids, "status": Status.QUEUED.value, "stream_url": stream_url(accepted.task_id)},
                      ensure_ascii=False, separators=(",", ":")).encode()


def claim(rt: Runtime, accepted: Accepted, body_202: bytes | None) -> Existing | None:
    """Claim the key and enqueue the call (None), or the earlier call with this key, which is the
    same request (a key reused for another request is refused here)."""
    call, grant = accepted.call, accepted.grant
    fp = fingerprint(grant.run_id, call.tool_name, call.call_id, call.parameters)
    try:
        found = rt.idempotency.claim(
            tenant=grant.tenant, key=accepted.key, fp=fp, run_id=grant.run_id, call_id=call.call_id,
            tool_name=call.tool_name, created_ms=int(time.time() * 1000), queue=call.tool.queue,
            accepted=(202, body_202) if body_202 else None, jti=grant.jti,
            audit=Audited(grant.sub, accepted.audit_subject(), rt.settings.audit_maxlen),
        )
    except QuotaExceeded as exc:
        metrics.quota_refused(exc.extra["quota"])
        raise
    except RateLimited:
        metrics.quota_refused("rate_limit")
        raise
    if isinstance(found, Admitted):
        metrics.idempotency("claimed")
        log.info("call accepted: %s", call.tool_name)
        _enqueue(rt, accepted, found)
        return None
    existing = found
    if existing.fingerprint != fp:
        metrics.idempotency("reused")
        raise IdempotencyKeyReused("This Idempotency-Key was used for a different request.",
                                   task_id=existing.task_id)
    metrics.idempotency("replayed" if existing.done and existing.code is not None else "in_use")
    return existing


def submit(rt: Runtime, accepted: Accepted) -> Response:
    """The REST answer: 202 at once (shell, or a file call slower than the wait), or the outcome."""
    call = accepted.call
    ids = {"task_id": accepted.task_id, "call_id": call.call_id, "tool_name": call.tool_name}
    body_202 = accepted_body(accepted)
    existing = claim(rt, accepted, body_202)
    if existing is not None:
        return _retry(existing, ids, call.tool.streams)
    if body_202 is not None:
        return _answer_shell(rt, accepted, ids, body_202)
    return _answer_file(rt, accepted, ids)


def run_to_end(rt: Runtime, accepted: Accepted, body_202: bytes | None, wait_s: float) -> TaskView | None:
    """The call's final record, for the surfaces that answer with the outcome (model-native, MCP):
    claimed and run, or the earlier call with this key (still running: waited for). None if it has
    not ended within `wait_s`."""
    existing = claim(rt, accepted, body_202)
    deadline = time.monotonic() + wait_s
    if existing is None:  # this request enqueued it, so it alone waits on the call's done signal
        rt.records.wait_done(accepted.task_id, wait_s)
    while (view := rt.records.get(accepted.task_id)) is not None and not view.status.terminal:
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)  # another request's call: its done signal is that request's to take
    return view


def _enqueue(rt: Runtime, accepted: Accepted, admitted: Admitted) -> None:
    """Publish the call to its Celery queue (under node placement, its run's node's), or, when that
    queue is at capacity or others wait, to its tenant's hold queue, then let the fair scheduler
    take turns (shared/scheduler.py)."""
    queue, tenant, direct = admitted.queue, accepted.grant.tenant, admitted.direct
    try:
        # ignore_result: the answer comes from runwarden's own records. Without it, Celery's Redis
        # backend subscribes this process to the task's result channel on every send, and
        # unsubscribes when the AsyncResult is collected: ~0.6 ms of API CPU a call (about 10 %).
        rt.celery.send_task(accepted.call.tool.task_name, args=[accepted.message()],
                            task_id=accepted.task_id, ignore_result=True, argsrepr=accepted.summary(),
                            kwargsrepr="{}", queue=queue if direct else hold_queue(queue, tenant))
        if not direct:
            rt.scheduler.kick(queue, tenant)
    except (OperationalError, RedisError, OSError):
        # Nothing ran: release the claim (only if still ours) so a retry can succeed; if Redis is
        # away, as soon as it is back.
        rt.releases.release(accepted.grant.tenant, accepted.key)
        raise Unavailable("The broker cannot be reached; nothing was run, retry shortly.") from None


def _answer_file(rt: Runtime, accepted: Accepted, ids: dict[str, str]) -> Response:
    """Wait for the worker's own record of the response (not Celery's result backend, which forgets)."""
    ended = rt.records.wait_done(accepted.task_id, rt.settings.wait_file_result_s)
    response = ended.response if ended and ended.response else rt.records.response(accepted.task_id)
    if response is None:
        return json_response({**ids, "status": Status.QUEUED.value}, 202)
    code, body = response
    return json_response(body, code, PROBLEM_JSON if code >= 400 else "application/json")


def _answer_shell(rt: Runtime, accepted: Accepted, ids: dict[str, str], accepted_body: bytes) -> Response:
    wait_s = prefer_wait()
    ended = rt.records.wait_done(accepted.task_id, wait_s) if wait_s else None
    if ended is not None and ended.status is None:  # its result was too large to ride along
        view = rt.records.get(accepted.task_id)
        ended = Ended(status=view.status, result=view.result) if view and view.status.terminal else None
    if ended is None or ended.status is None:
        return json_response(accepted_body, 202)
    body = json.dumps({**ids, "status": ended.status.value, "result": ended.result,  # as GET shows it
                       "stream_url": stream_url(accepted.task_id)}, ensure_ascii=False, separators=(",", ":"))
    rt.idempotency.record_response(accepted.grant.tenant, accepted.key, 200, body.encode())
    return json_response(body.encode(), 200, headers={"Preference-Applied": f"wait={wait_s}"})


def _retry(existing: Existing, ids: dict[str, str], shell: bool) -> Response:
    if not existing.done or existing.code is None:
        error = IdempotencyKeyInUse("The first request with this key is still running.", task_id=existing.task_id)
        if shell:
            error.extra["stream_url"] = stream_url(existing.task_id)
        error.headers["Retry-After"] = "1"
        return problem_response(error)
    content_type = PROBLEM_JSON if existing.code >= 400 else "application/json"
    return json_response(existing.body, existing.code, content_type, {"Idempotent-Replayed": "true"})

