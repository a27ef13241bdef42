"""The formats models speak (contract section 8): `POST /v1/tool-use` takes Anthropic `tool_use`
blocks, `POST /v1/openai/tool-calls` OpenAI `tool_calls` entries, one or a turn's array of them.

Each block becomes the same `ToolCall` a `POST /v1/tool-calls` would carry and takes the same path
(`dispatch.authorize`, then `dispatch.run_to_end`: claim, enqueue, wait); its outcome is rendered
by `api.native`. A turn's blocks run concurrently and are answered in the order sent. Refusals the
model can correct come back as error results; those that concern the caller stay HTTP problems.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, request

from api import dispatch, native, openapi
from api.auth import authenticate
from api.problems import json_response
from api.runtime import Runtime, runtime
from shared import keys
from shared.errors import CommandForbidden, IdempotencyKeyReused, PathForbidden, SchemaInvalid, UnsupportedMediaType
from shared.idempotency import KEY_RE, parse_key
from shared.schema import loads, parse_tool_call
from shared.tokens import Grant

bp = Blueprint("tool_use", __name__)
MAX_BLOCKS = openapi.MAX_BLOCKS  # one assistant turn's parallel calls; more is refused, not queued
MAX_ID = 256
PARALLEL = 16  # threads a turn's blocks run on
SLACK_S = 30  # beyond the call's own limit, for its time in the queue
# call_id of a block: a UUID derived from its id, the same on every API replica.
CALL_ID_NAMESPACE = uuid.UUID("8f9d2c4e-7a61-4b0f-b3d5-0c6e1a2f9b47")


@dataclass(frozen=True)
class Block:
    """One block as sent: its id, and the tool call it names (or why it names none)."""

    id: str
    name: Any
    arguments: Any
    arguments_error: str | None = None


@dataclass(frozen=True)
class Plan:
    """A block ready to run (`accepted`), or already answered (`rendered`, a refusal)."""

    block: Block
    accepted: dispatch.Accepted | None = None
    body_202: bytes | None = None
    stream_url: str | None = None
    rendered: native.Rendered | None = None


def _block_id(raw: dict[str, Any], pointer: str) -> str:
    block_id = raw.get("id")
    if not isinstance(block_id, str) or not 0 < len(block_id) <= MAX_ID:
        raise SchemaInvalid("Each block needs an id: a string of 1-256 characters.",
                            errors=[{"pointer": f"{pointer}/id", "message": "must be a non-empty string"}])
    return block_id


def anthropic_block(raw: Any, pointer: str) -> Block:
    if not isinstance(raw, dict) or raw.get("type") != "tool_use":
        raise SchemaInvalid("Send tool_use content blocks.",
                            errors=[{"pointer": f"{pointer}/type", "message": "must be 'tool_use'"}])
    return Block(_block_id(raw, pointer), raw.get("name"), raw.get("input"))


def openai_block(raw: Any, pointer: str) -> Block:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type", "function") != "function" or not isinstance(function, dict):
        raise SchemaInvalid("Send entries of an assistant message's tool_calls.",
                            errors=[{"pointer": f"{pointer}/function", "message": "must be a function call"}])
    block_id, text = _block_id(raw, pointer), function.get("arguments")
    if not isinstance(text, str):
        return Block(block_id, function.get("name"), None, "function.arguments must be a string of JSON text.")
    try:
        return Block(block_id, function.get("name"), loads(text.encode()))
    except SchemaInvalid:
        return Block(block_id, function.get("name"), None, "function.arguments is not valid JSON text.")


def _blocks(parse_block: Callable[[Any, str], Block]) -> tuple[list[Block], bool]:
    if request.mimetype not in ("application/json", ""):
        raise UnsupportedMediaType("Send the blocks as application/json.")
    body = loads(request.get_data(cache=True))
    single = not isinstance(body, list)
    items: list[Any] = body if isinstance(body, list) else [body]
    if not 0 < len(items) <= MAX_BLOCKS:
        raise SchemaInvalid(f"Send one block or an array of 1-{MAX_BLOCKS}.",
                            errors=[{"pointer": "", "message": f"1-{MAX_BLOCKS} blocks"}])
    blocks = [parse_block(item, "" if single else f"/{index}") for index, item in enumerate(items)]
    if len({block.id for block in blocks}) != len(blocks):
        raise SchemaInvalid("Each block of a turn needs its own id.",
                            errors=[{"pointer": "", "message": "duplicate id"}])
    return blocks, single


def _key(block: Block, header_key: str | None, index: int, single: bool) -> str:
    """The header's key (one per block of an array), else the block's id: a retry of the same
    block is the same call."""
    if header_key is not None:
        return header_key if single else f"{header_key}:{index}"
    if KEY_RE.fullmatch(block.id):
        return block.id
    return "id-sha256:" + hashlib.sha256(block.id.encode()).hexdigest()


def _block_pointer(pointer: str, arguments_field: str) -> str:
    if pointer.startswith("/parameters"):
        return arguments_field + pointer[len("/parameters"):]
    return "/name" if pointer == "/tool_name" else pointer


def _plan(block: Block, grant: Grant, key: str, arguments_field: str) -> Plan:
    """Validate and authorize as `POST /v1/tool-calls` does. A refusal the model can correct is
    its answer; one that concerns the caller (scope) raises, for the whole request."""
    if block.arguments_error:
        return Plan(block, rendered=native.refusal(SchemaInvalid(block.arguments_error)))
    envelope = {"tool_name": block.name, "call_id": str(uuid.uuid5(CALL_ID_NAMESPACE, block.id)),
                "parameters": block.arguments}
    try:
        call = dispatch.authorize(parse_tool_call(envelope), grant)
    except SchemaInvalid as exc:
        for error in exc.extra.get("errors", []):  # name the block's own fields, not the envelope's
            error["pointer"] = _block_pointer(error["pointer"], arguments_field)
        return Plan(block, rendered=native.refusal(exc))
    except (PathForbidden, CommandForbidden) as exc:
        return Plan(block, rendered=native.refusal(exc))
    accepted = dispatch.Accepted(call, grant, key, keys.task_id_for(grant.tenant, key))
    streams = call.tool.streams
    return Plan(block, accepted, dispatch.accepted_body(accepted),
                dispatch.stream_url(accepted.task_id) if streams else None)


def _run(rt: Runtime, plan: Plan) -> native.Rendered:
    if plan.rendered is not None or plan.accepted is None:
        return plan.rendered or native.Rendered()
    call = plan.accepted.call
    limit_s = call.parameters["timeout_ms"] / 1000 if call.tool.streams else rt.settings.wait_file_result_s
    try:
        view = dispatch.run_to_end(rt, plan.accepted, plan.body_202, limit_s + rt.settings.kill_grace_s + SLACK_S)
    except IdempotencyKeyReused as exc:
        return native.refusal(exc)
    return native.outcome(view, plan.accepted.task_id, plan.stream_url)


def serve(parse_block: Callable[[Any, str], Block], shape: Callable[[native.Rendered, str], dict[str, Any]],
          arguments_field: str) -> Response:
    grant = authenticate()
    blocks, single = _blocks(parse_block)
    header = request.headers.getlist("Idempotency-Key")
    header_key = parse_key(header) if header else None
    plans = [_plan(block, grant, _key(block, header_key, index, single), arguments_field)
             for index, block in enumerate(blocks)]
    rt = runtime()
    if len(plans) == 1:
        rendered = [_run(rt, plans[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(len(plans), PARALLEL)) as pool:
            futures = [pool.submit(_run, rt, plan) for plan in plans]
        rendered = [future.result() for future in futures]  # the first service failure raises
    answers = [shape(result, plan.block.id) for result, plan in zip(rendered, plans)]
    return json_response(json.dumps(answers[0] if single else answers, ensure_ascii=False, separators=(",", ":")))


@bp.post("/v1/tool-use")
def anthropic() -> Response:
    return serve(anthropic_block, native.Rendered.anthropic, "/input")


@bp.post("/v1/openai/tool-calls")
def openai() -> Response:
    return serve(openai_block, native.Rendered.openai, "/function/arguments")

