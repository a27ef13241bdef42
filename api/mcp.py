"""The Model Context Protocol over Streamable HTTP (contract section 9), served statelessly.

One POST carries one JSON-RPC message (2025-06-18 and later have no batches). A notification is
answered 202 with no body; a request gets its response as JSON, or, for a shell `tools/call`
carrying a progress token, as an SSE stream of `notifications/progress` (one per output chunk, read
from the call's Redis Stream) ending with the response. No session is kept: the tools a token sees
and may call follow from the token alone, and `notifications/cancelled` finds its call through a
short-lived Redis key (`keys.mcp_request`).

Messages are parsed and results shaped with `mcp-types`, the official SDK's pydantic models:
`mcp_types.methods` validates a request against its protocol revision's schema and shapes each
result for it. A call takes the path of every model-facing surface (`api.calls`), and its outcome
is rendered by `api.native`: a refusal the model can correct is an `isError` result; a refusal that
concerns the caller is a JSON-RPC error (a tool the token may not call, like an unknown one, is
-32602) or, where HTTP decides (401, 429, 503), the HTTP problem every endpoint answers.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import mcp_types as mt
from flask import Response
from mcp_types import methods
from pydantic import BaseModel, ValidationError

from api import calls, dispatch, native
from api.follow import Follower
from api.routes.tool_calls import request_cancel
from api.runtime import Runtime
from shared import keys
from shared.errors import ForbiddenScope, IdempotencyKeyReused, RunwardenError, SchemaInvalid
from shared.idempotency import parse_key
from shared.records import TaskView
from shared.schema import TOOLS, Tool, loads
from shared.tokens import Grant

log = logging.getLogger("runwarden.mcp")

VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")  # the newest first: answered when asked for another
META = "runwarden.dev/"  # prefix of the `_meta` keys runwarden adds
CANCEL_SLACK_S = 60  # how much longer than the call's longest wait its request id stays cancellable
INSTRUCTIONS = (
    "runwarden runs these tools in the sandboxed workspace of your token's run. Read a file before you "
    "patch it: apply_file_patch needs the file's sha (from read_file) as base_sha. A shell command runs "
    "at most timeout_ms (60 s at most); a non-zero exit code is a result, not a failure of the call."
)
try:
    SERVER_VERSION = metadata.version("runwarden")
except metadata.PackageNotFoundError:  # running from a checkout that was never installed
    SERVER_VERSION = "0"


@dataclass(frozen=True)
class Exchange:
    """One POST: who sent it and what its headers ask for."""

    rt: Runtime
    grant: Grant
    version_header: str | None  # MCP-Protocol-Version, sent on every request after initialize
    idempotency_key: list[str]  # the Idempotency-Key header's values (a tools/call's, if any)
    accepts_sse: bool


class RpcError(Exception):
    """A JSON-RPC error answer; `status` is the HTTP status it travels with."""

    def __init__(self, code: int, message: str, data: Any = None, status: int = 200) -> None:
        super().__init__(message)
        fields = {"data": data} if data is not None else {}  # an unset `data` is left out of the answer
        self.error = mt.ErrorData(code=code, message=message, **fields)
        self.status = status


def answer(exchange: Exchange, raw: bytes) -> Response:
    """The HTTP answer to one POSTed message."""
    try:
        body = loads(raw)
    except SchemaInvalid:
        return _error_response(None, RpcError(mt.PARSE_ERROR, "Parse error: the body is not JSON text.", status=400))
    try:
        message = _message(body)
    except RpcError as error:
        return _error_response(_id_of(body), error)
    if isinstance(message, mt.JSONRPCRequest):
        return _request(exchange, message)
    if isinstance(message, mt.JSONRPCNotification):
        _notification(exchange, message)
    accepted = Response(status=202)  # a notification, or a client's response: nothing to answer
    del accepted.headers["Content-Type"]  # no body, so no type
    return accepted


def _message(body: Any) -> mt.JSONRPCRequest | mt.JSONRPCNotification | None:
    """The request or notification the body holds; None for a response (we send no requests)."""
    if isinstance(body, list):
        raise RpcError(mt.INVALID_REQUEST, "Batches are not supported: POST one JSON-RPC message at a time.",
                       status=400)
    try:
        if isinstance(body, dict) and "method" in body:
            kind: type[BaseModel] = mt.JSONRPCRequest if "id" in body else mt.JSONRPCNotification
            return kind.model_validate(body)  # type: ignore[return-value]
        mt.jsonrpc_message_adapter.validate_python(body)
        return None
    except ValidationError:
        raise RpcError(mt.INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message.",
                       data=_invalid(body), status=400) from None


def _invalid(body: Any) -> list[dict[str, str]]:
    """Which envelope fields are wrong, as JSON pointers (pydantic's own messages echo the input)."""
    if not isinstance(body, dict):
        return [{"pointer": "", "message": "must be a JSON-RPC message object"}]
    checks = {"jsonrpc": body.get("jsonrpc") == "2.0",
              "method": isinstance(body.get("method", ""), str),
              "id": "id" not in body or _id_of(body) is not None,
              "params": isinstance(body.get("params", {}), dict)}
    return [{"pointer": f"/{name}", "message": "invalid"} for name, ok in checks.items() if not ok] or \
        [{"pointer": "", "message": "not a request, notification or response"}]


def _id_of(body: Any) -> str | int | None:
    request_id = body.get("id") if isinstance(body, dict) else None
    return request_id if isinstance(request_id, str) or type(request_id) is int else None


def _request(exchange: Exchange, message: mt.JSONRPCRequest) -> Response:
    handler = HANDLERS.get(message.method)
    try:
        if handler is None:
            raise RpcError(mt.METHOD_NOT_FOUND, f"Method not found: {message.method[:100]}")
        version = VERSIONS[0] if message.method == "initialize" else _version(exchange)
        try:
            request = methods.parse_client_request(message.method, version, message.params)
        except ValidationError as exc:
            raise RpcError(mt.INVALID_PARAMS, "Invalid params.", data=_pointers(exc)) from None
        return handler(exchange, message.id, version, request)
    except RpcError as error:
        return _error_response(message.id, error)


def _version(exchange: Exchange) -> str:
    """The revision a request after initialize speaks (its header; 2025-03-26 when absent, as the
    transport says); an unsupported one is refused with 400, as the transport requires."""
    header = exchange.version_header
    if header is None:
        return mt.DEFAULT_NEGOTIATED_VERSION
    if header not in VERSIONS:
        raise RpcError(mt.INVALID_REQUEST, "Unsupported MCP-Protocol-Version.",
                       data={"supported": list(VERSIONS), "requested": header[:64]}, status=400)
    return header


def _pointers(exc: ValidationError) -> list[dict[str, str]]:
    return [{"pointer": "".join(f"/{part}" for part in error["loc"]), "message": error["msg"][:300]}
            for error in exc.errors(include_url=False, include_input=False)[:20]]


def _initialize(exchange: Exchange, request_id: Any, _: str, request: Any) -> Response:
    asked = request.params.protocol_version
    version = asked if asked in VERSIONS else VERSIONS[0]
    result = mt.InitializeResult(
        protocol_version=version, instructions=INSTRUCTIONS,
        capabilities=mt.ServerCapabilities(tools=mt.ToolsCapability(list_changed=False)),
        server_info=mt.Implementation(name="runwarden", version=SERVER_VERSION))
    return _json(_result(request_id, "initialize", version, result))


def _ping(exchange: Exchange, request_id: Any, version: str, _: Any) -> Response:
    return _json(_result(request_id, "ping", version, mt.EmptyResult()))


def _list_tools(exchange: Exchange, request_id: Any, version: str, _: Any) -> Response:
    """The tools this token's scopes allow (no pagination: they are few)."""
    grant = exchange.grant
    tools = [mcp_tool(tool, grant) for tool in TOOLS.values() if tool.scope in grant.scopes]
    return _json(_result(request_id, "tools/list", version, mt.ListToolsResult(tools=tools)))


def mcp_tool(tool: Tool, grant: Grant) -> mt.Tool:
    open_world = tool.streams and "shell:network" in grant.scopes  # a sandbox without network is closed
    hints = (mt.ToolAnnotations(read_only_hint=True, open_world_hint=False) if tool.read_only else
             mt.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=tool.idempotent,
                                 open_world_hint=open_world))
    return mt.Tool(name=tool.name, description=tool.description, input_schema=tool.parameters,
                    output_schema=tool.result, annotations=hints)


def _call_tool(exchange: Exchange, request_id: Any, version: str, request: Any) -> Response:
    """Validated and authorized as `POST /v1/tool-calls`, through the same dispatch path."""
    params = request.params
    if params.name not in TOOLS:  # the MCP spec's protocol error, not a tool's: the tool list names them
        raise RpcError(mt.INVALID_PARAMS, f"Unknown tool: {params.name[:100]}", data={
            "code": "schema_invalid", "errors": [{"pointer": "/params/name", "message": f"one of {sorted(TOOLS)}"}]})
    # Without a header each call runs: clients number requests from 0 in every session, so an id
    # names no call beyond its own request.
    key = parse_key(exchange.idempotency_key) if exchange.idempotency_key else f"mcp-{uuid.uuid4()}"
    plan = _caller_refusal(lambda: calls.plan(params.name, params.arguments or {}, exchange.grant, key,
                                              calls.call_id_for(key), "/arguments"))
    if plan.accepted is None:
        return _json(_result(request_id, "tools/call", version, tool_result(plan.rendered, refusal=plan.refusal)))
    _remember(exchange, request_id, plan.accepted)
    token = (params.meta or {}).get("progress_token")
    if plan.accepted.call.tool.streams and token is not None and exchange.accepts_sse:
        return _stream(exchange.rt, request_id, version, plan, plan.accepted, token)
    ran = _caller_refusal(lambda: calls.run(exchange.rt, plan))
    result = tool_result(ran.rendered, ran.view, plan)
    return _json(_result(request_id, "tools/call", version, result))


def _caller_refusal(step: Callable[[], Any]) -> Any:
    """A refusal that concerns the caller, not the model, as a JSON-RPC error carrying its problem:
    a tool the token may not call (not in its tools/list), an Idempotency-Key sent for another call."""
    try:
        return step()
    except (ForbiddenScope, IdempotencyKeyReused) as exc:
        raise RpcError(mt.INVALID_PARAMS, exc.detail, data=exc.problem()) from None


def _remember(exchange: Exchange, request_id: Any, accepted: dispatch.Accepted) -> None:
    """Map the request's id to its task, for a `notifications/cancelled` that names it."""
    grant, rt = exchange.grant, exchange.rt
    name = keys.mcp_request(grant.tenant, grant.run_id, grant.sub, json.dumps(request_id))
    rt.redis.set(name, accepted.task_id, ex=int(calls.wait_s(rt, accepted)) + CANCEL_SLACK_S)


def tool_result(rendered: native.Rendered | None, view: TaskView | None = None, plan: calls.Plan | None = None,
                refusal: RunwardenError | None = None) -> mt.CallToolResult:
    """`content` as `api.native` renders it; `structuredContent` the `result` of GET
    /v1/tool-calls/{id} (for a call refused before it was accepted: the refusal, shaped as a failed
    call's result); `_meta` names the task and its stream."""
    rendered = rendered or native.Rendered()
    structured: Any = None
    if view is not None and view.status.terminal and isinstance(view.result, dict):
        structured = view.result
    elif refusal is not None:
        structured = {"code": refusal.code, "message": refusal.detail, **refusal.extra}
    meta: dict[str, Any] = {}
    if plan is not None and plan.accepted is not None:
        meta[META + "task_id"] = plan.accepted.task_id
        if plan.stream_url:
            meta[META + "stream_url"] = plan.stream_url
    return mt.CallToolResult(content=[mt.TextContent(text=text) for text in rendered.texts],
                              structured_content=structured, is_error=rendered.is_error, _meta=meta or None)


def _stream(rt: Runtime, request_id: Any, version: str, plan: calls.Plan, accepted: dispatch.Accepted,
            token: str | int) -> Response:
    """Claimed here, so that a refusal is still an ordinary answer; then followed as SSE."""
    _caller_refusal(lambda: dispatch.claim(rt, accepted, plan.body_202))
    messages = _progress_then_result(rt, request_id, version, plan, accepted, token)
    return Response(_sse(messages), content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _progress_then_result(rt: Runtime, request_id: Any, version: str, plan: calls.Plan,
                          accepted: dispatch.Accepted, token: str | int) -> Iterator[dict[str, Any] | None]:
    """Each output event as a progress notification, then the response (None: nothing new for a
    while). Runs after the view returned: it reads nothing of Flask's request."""
    deadline = time.monotonic() + calls.wait_s(rt, accepted)
    try:
        for event in Follower(rt, accepted.task_id).events(lambda: int((deadline - time.monotonic()) * 1000)):
            if event is None:
                yield None
            elif (note := progress(token, loads(event))) is not None:
                yield note
        view = rt.records.get(accepted.task_id)
        rendered = native.outcome(view, accepted.task_id, plan.stream_url)
        yield _result(request_id, "tools/call", version, tool_result(rendered, view, plan))
    except Exception as exc:  # the answer has begun: no HTTP problem can follow, a JSON-RPC error can
        log.warning("MCP stream of %s ended early: %s", accepted.task_id, type(exc).__name__)
        data = exc.problem() if isinstance(exc, RunwardenError) else None
        error = RpcError(mt.INTERNAL_ERROR, "The call's output could not be followed; retry shortly.", data=data)
        yield mt.JSONRPCError(jsonrpc="2.0", id=request_id, error=error.error).model_dump(mode="json",
                                                                                            exclude_unset=True)


def progress(token: str | int, event: dict[str, Any]) -> dict[str, Any] | None:
    """An output event as `notifications/progress`: `progress` is its seq, `message` its text exactly;
    bytes that are not UTF-8 come as their base64, marked "[base64] ". `_meta` names the stream and
    the encoding."""
    if event.get("type") != "output":
        return None
    text, encoding = event.get("data"), "utf-8"
    if text is None:
        text, encoding = "[base64] " + str(event.get("data_b64", "")), "base64"
    params = mt.ProgressNotificationParams(progress_token=token, progress=event["seq"], message=text,
                                            _meta={META + "stream": event.get("stream"), META + "encoding": encoding})
    return {"jsonrpc": "2.0", **mt.ProgressNotification(params=params).model_dump(by_alias=True, exclude_none=True,
                                                                                     mode="json")}


def _sse(messages: Iterator[dict[str, Any] | None]) -> Iterator[str]:
    """SSE events without ids (no resumption: GET /mcp is 405); a comment while nothing happens, so
    that a client that went away is noticed and its thread freed."""
    for message in messages:
        if message is None:
            yield ": running\n\n"
        else:
            yield "event: message\ndata: " + json.dumps(message, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _notification(exchange: Exchange, message: mt.JSONRPCNotification) -> None:
    """Only `notifications/cancelled` asks for anything; a notification is never answered."""
    if message.method != "notifications/cancelled":
        return
    try:
        note = methods.parse_client_notification(message.method, VERSIONS[0], message.params)
    except ValidationError:
        return
    request_id = note.params.request_id  # type: ignore[attr-defined]
    grant, rt = exchange.grant, exchange.rt
    task_id = rt.redis.get(keys.mcp_request(grant.tenant, grant.run_id, grant.sub, json.dumps(request_id)))
    view = rt.records.get(task_id.decode()) if task_id else None
    if view is None or (view.tenant, view.run_id) != (grant.tenant, grant.run_id):
        return
    if TOOLS[view.tool_name].scope in grant.scopes:  # as DELETE /v1/tool-calls/{id} requires
        request_cancel(rt, view)


def _result(request_id: Any, method: str, version: str, result: mt.Result) -> dict[str, Any]:
    """The JSON-RPC response, its result shaped for the revision (fields it lacks are dropped)."""
    shaped = methods.serialize_server_result(method, version, result.model_dump(by_alias=True, exclude_none=True,
                                                                                 mode="json"))
    return mt.JSONRPCResponse(jsonrpc="2.0", id=request_id, result=shaped).model_dump(mode="json")


def _error_response(request_id: Any, error: RpcError) -> Response:
    message = mt.JSONRPCError(jsonrpc="2.0", id=request_id, error=error.error)
    return _json(message.model_dump(mode="json", exclude_unset=True), error.status)


def _json(message: dict[str, Any], status: int = 200) -> Response:
    return Response(json.dumps(message, ensure_ascii=False, separators=(",", ":")), status=status,
                    content_type="application/json")


HANDLERS: dict[str, Callable[[Exchange, Any, str, Any], Response]] = {
    "initialize": _initialize, "ping": _ping, "tools/list": _list_tools, "tools/call": _call_tool,
}
