"""POST, GET and DELETE of tool calls."""
from __future__ import annotations

import time

from flask import Blueprint, Response, g, request

from api import dispatch
from api.auth import authenticate, refuse_if_revoked
from api.problems import json_response
from api.runtime import Runtime, runtime
from shared import keys, logs
from shared.errors import NotFound, RunwardenError, SchemaInvalid, UnsupportedMediaType
from shared.idempotency import parse_key
from shared.records import TaskView
from shared.schema import TOOLS, loads, parse_tool_call
from shared.tokens import Grant

bp = Blueprint("tool_calls", __name__)
TASK_ID_MAX = 64


MAX_EARLY_PARSE = 1 << 21
_UNREAD = object()


def _read_body() -> None:
    """Parse the body once, before authentication, so that even refusals carry call_id and
    tool_name as sent; a parse error is kept and raised by `_body`, after the token and key checks."""
    g.body, g.body_error = _UNREAD, None
    if (request.content_length or 0) > MAX_EARLY_PARSE:
        return  # read (and refused with 413) by `_body`, after authentication
    try:
        g.body = loads(request.get_data(cache=True))
    except SchemaInvalid as exc:
        g.body_error = exc
    if isinstance(g.body, dict):
        g.call_context = {k: g.body[k] for k in ("call_id", "tool_name") if isinstance(g.body.get(k), str)
                          and len(g.body[k]) <= 256}


def _body() -> object:
    if request.mimetype not in ("application/json", ""):  # a missing Content-Type is read as JSON
        raise UnsupportedMediaType("Send the tool call as application/json.")
    if g.body_error is not None:
        raise g.body_error
    if g.body is _UNREAD:
        return loads(request.get_data(cache=True))  # bounded by MAX_CONTENT_LENGTH: larger is a 413
    return g.body


@bp.post("/v1/tool-calls")
def create() -> Response:
    _read_body()
    grant = authenticate(check_revoked=False)  # the claim checks it, in the same round trip
    try:
        key = parse_key(request.headers.getlist("Idempotency-Key"))
        g.call_context = {**getattr(g, "call_context", {}), "task_id": keys.task_id_for(grant.tenant, key)}
        logs.bind(task_id=g.call_context["task_id"], call_id=g.call_context.get("call_id"))
        call = dispatch.authorize(parse_tool_call(_body()), grant)
    except RunwardenError:
        refuse_if_revoked(grant)  # a revoked token is told so first, whatever else is wrong
        raise
    accepted = dispatch.Accepted(call, grant, key, keys.task_id_for(grant.tenant, key))
    return dispatch.submit(runtime(), accepted)


def _owned_task(task_id: str, grant: Grant) -> TaskView:
    """The task if this token's tenant and run own it; anything else is the same 404."""
    if len(task_id) > TASK_ID_MAX:
        raise NotFound("No such task.")
    view = runtime().records.get(task_id)
    if view is None or view.tenant != grant.tenant or view.run_id != grant.run_id:
        raise NotFound("No such task.")
    return view


def _view_body(view: TaskView) -> dict[str, object]:
    body = view.public()
    if TOOLS[view.tool_name].streams:
        body["stream_url"] = dispatch.stream_url(view.task_id)
    return body


@bp.get("/v1/tool-calls/<task_id>")
def show(task_id: str) -> Response:
    grant = authenticate()
    view = _owned_task(task_id, grant)
    if view.status.value == "running" and TOOLS[view.tool_name].streams and runtime().records.reap(task_id):
        view = _owned_task(task_id, grant)
    return json_response(_view_body(view))


def request_cancel(rt: Runtime, view: TaskView) -> str:
    """Cancel a call: a queued one never starts, a running one's worker is told to end it (SIGTERM,
    then SIGKILL). Returns the status found."""
    return rt.records.cancel(view)


@bp.delete("/v1/tool-calls/<task_id>")
def cancel(task_id: str) -> Response:
    grant = authenticate()
    view = _owned_task(task_id, grant)
    grant.require_scope(TOOLS[view.tool_name].scope)
    rt = runtime()
    if request_cancel(rt, view) == "running":
        deadline = time.monotonic() + rt.settings.kill_grace_s + 3
        while time.monotonic() < deadline and not view.status.terminal:
            time.sleep(0.05)
            view = _owned_task(task_id, grant)
    else:
        view = _owned_task(task_id, grant)
    return json_response(_view_body(view), 200 if view.status.terminal else 202)
