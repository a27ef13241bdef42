"""POST, GET and DELETE of tool calls."""
from __future__ import annotations

import json
import time

from flask import Blueprint, Response, g, request

from api import dispatch
from api.auth import authenticate
from api.problems import json_response
from api.runtime import runtime
from shared import keys
from shared.errors import NotFound, SchemaInvalid, UnsupportedMediaType
from shared.idempotency import parse_key
from shared.records import TaskView
from shared.schema import TOOLS, parse_tool_call
from shared.tokens import Grant

bp = Blueprint("tool_calls", __name__)
TASK_ID_MAX = 64


def _echo_call_ids() -> None:
    """Errors before the call is parsed still carry call_id and tool_name as sent, when there are some."""
    try:
        body = request.get_json(force=True, silent=True, cache=True) if (request.content_length or 0) <= 1 << 21 else None
    except RecursionError:
        body = None
    if isinstance(body, dict):
        g.call_context = {k: body[k] for k in ("call_id", "tool_name") if isinstance(body.get(k), str)
                          and len(body[k]) <= 256}


def _body() -> object:
    if request.mimetype not in ("application/json", ""):  # a missing Content-Type is read as JSON
        raise UnsupportedMediaType("Send the tool call as application/json.")
    raw = request.get_data(cache=True)  # bounded by MAX_CONTENT_LENGTH: larger is a 413 before this
    try:
        body = json.loads(raw)
        # A lone surrogate ("\ud800") is valid JSON but no file name, command or output can hold it.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError):
        raise SchemaInvalid("The body is not valid JSON of UTF-8 text.",
                            errors=[{"pointer": "", "message": "invalid JSON"}]) from None
    return body


@bp.post("/v1/tool-calls")
def create() -> Response:
    _echo_call_ids()
    grant = authenticate()
    key = parse_key(request.headers.getlist("Idempotency-Key"))
    g.call_context = {**getattr(g, "call_context", {}), "task_id": keys.task_id_for(grant.tenant, key)}
    call = dispatch.authorize(parse_tool_call(_body()), grant)
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
    if view.tool_name == dispatch.SHELL:
        body["stream_url"] = dispatch.stream_url(view.task_id)
    return body


@bp.get("/v1/tool-calls/<task_id>")
def show(task_id: str) -> Response:
    grant = authenticate()
    view = _owned_task(task_id, grant)
    if view.status.value == "running" and view.tool_name == dispatch.SHELL and runtime().records.reap(task_id):
        view = _owned_task(task_id, grant)
    return json_response(_view_body(view))


@bp.delete("/v1/tool-calls/<task_id>")
def cancel(task_id: str) -> Response:
    grant = authenticate()
    view = _owned_task(task_id, grant)
    grant.require_scope(TOOLS[view.tool_name].scope)
    rt = runtime()
    found = rt.records.cancel(view)
    if found == "running":
        rt.redis.publish(keys.control(task_id), json.dumps({"cancel": True}))
        deadline = time.monotonic() + rt.settings.kill_grace_s + 3
        while time.monotonic() < deadline and not view.status.terminal:
            time.sleep(0.05)
            view = _owned_task(task_id, grant)
    else:
        view = _owned_task(task_id, grant)
    return json_response(_view_body(view), 200 if view.status.terminal else 202)
