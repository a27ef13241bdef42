"""A tool call a model names (`tool_use`, OpenAI `tool_calls`, MCP `tools/call`): a tool name and
its arguments, planned exactly as `POST /v1/tool-calls` plans a call, run to its end through
`dispatch.run_to_end`, and rendered by `api.native`.

Planning validates and authorizes (`parse_tool_call`, `dispatch.authorize`): a refusal the model
can correct becomes the call's answer; one that concerns the caller (a missing scope) raises, for
the surface to answer as its own protocol says.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from api import dispatch, native
from api.runtime import Runtime
from shared import keys
from shared.errors import CommandForbidden, PathForbidden, RunwardenError, SchemaInvalid
from shared.records import TaskView
from shared.schema import parse_tool_call
from shared.tokens import Grant

SLACK_S = 30  # beyond the call's own limit, for its time in the queue
# call_id of a model's call: a UUID derived from its id (or key), the same on every API replica.
CALL_ID_NAMESPACE = uuid.UUID("8f9d2c4e-7a61-4b0f-b3d5-0c6e1a2f9b47")


@dataclass(frozen=True)
class Plan:
    """A call ready to run (`accepted`), or already answered (`rendered`, from `refusal`)."""

    accepted: dispatch.Accepted | None = None
    body_202: bytes | None = None
    stream_url: str | None = None
    rendered: native.Rendered | None = None
    refusal: RunwardenError | None = None


@dataclass(frozen=True)
class Ran:
    """A planned call's final record (None: refused, or not ended in time) and its rendering."""

    view: TaskView | None
    rendered: native.Rendered


def call_id_for(seed: str) -> str:
    return str(uuid.uuid5(CALL_ID_NAMESPACE, seed))


def _refused(error: RunwardenError) -> Plan:
    return Plan(rendered=native.refusal(error), refusal=error)


def _pointer(pointer: str, arguments_field: str) -> str:
    """An envelope pointer as the model's own block names it (`/parameters/x` → `/input/x`)."""
    if pointer.startswith("/parameters"):
        return arguments_field + pointer[len("/parameters"):]
    return "/name" if pointer == "/tool_name" else pointer


def plan(name: Any, arguments: Any, grant: Grant, key: str, call_id: str, arguments_field: str,
         arguments_error: str | None = None) -> Plan:
    """Validate and authorize as `POST /v1/tool-calls` does; raises `ForbiddenScope`."""
    if arguments_error:
        return _refused(SchemaInvalid(arguments_error))
    envelope = {"tool_name": name, "call_id": call_id, "parameters": arguments}
    try:
        call = dispatch.authorize(parse_tool_call(envelope), grant)
    except SchemaInvalid as exc:
        for error in exc.extra.get("errors", []):  # name the block's own fields, not the envelope's
            error["pointer"] = _pointer(error["pointer"], arguments_field)
        return _refused(exc)
    except (PathForbidden, CommandForbidden) as exc:
        return _refused(exc)
    accepted = dispatch.Accepted(call, grant, key, keys.task_id_for(grant.tenant, key))
    streams = call.tool.streams
    return Plan(accepted, dispatch.accepted_body(accepted),
                dispatch.stream_url(accepted.task_id) if streams else None)


def wait_s(rt: Runtime, accepted: dispatch.Accepted) -> float:
    """How long a surface waits for the call's end: its own limit, the kill grace and the queue."""
    call = accepted.call
    limit_s = call.parameters["timeout_ms"] / 1000 if call.tool.streams else rt.settings.wait_file_result_s
    return limit_s + rt.settings.kill_grace_s + SLACK_S


def run(rt: Runtime, plan: Plan) -> Ran:
    """Claim, enqueue and wait (or find the earlier call with this key); raises
    `IdempotencyKeyReused`, and the service failures `native.outcome` raises."""
    if plan.accepted is None:
        return Ran(None, plan.rendered or native.Rendered())
    view = dispatch.run_to_end(rt, plan.accepted, plan.body_202, wait_s(rt, plan.accepted))
    return Ran(view, native.outcome(view, plan.accepted.task_id, plan.stream_url))
