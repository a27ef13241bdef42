"""The formats models speak (contract section 8): `POST /v1/tool-use` takes Anthropic `tool_use`
blocks, `POST /v1/openai/tool-calls` OpenAI `tool_calls` entries, one or a turn's array of them.

Each block becomes the same `ToolCall` a `POST /v1/tool-calls` would carry and takes the same path
(`api.calls`: `dispatch.authorize`, then `dispatch.run_to_end`: claim, enqueue, wait); its outcome
is rendered by `api.native`. A turn's blocks run concurrently and are answered in the order sent.
Refusals the model can correct come back as error results; those that concern the caller stay HTTP
problems.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, request

from api import calls, native, openapi
from api.auth import authenticate
from api.problems import json_response
from api.runtime import Runtime, runtime
from shared.errors import IdempotencyKeyReused, SchemaInvalid, UnsupportedMediaType
from shared.idempotency import KEY_RE, parse_key
from shared.schema import loads

bp = Blueprint("tool_use", __name__)
MAX_BLOCKS = openapi.MAX_BLOCKS  # one assistant turn's parallel calls; more is refused, not queued
MAX_ID = 256
PARALLEL = 16  # threads a turn's blocks run on


@dataclass(frozen=True)
class Block:
    """One block as sent: its id, and the tool call it names (or why it names none)."""

    id: str
    name: Any
    arguments: Any
    arguments_error: str | None = None


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


def _run(rt: Runtime, plan: calls.Plan) -> native.Rendered:
    try:
        return calls.run(rt, plan).rendered
    except IdempotencyKeyReused as exc:  # the block's id (its key) names another call: the model's to fix
        return native.refusal(exc)


def serve(parse_block: Callable[[Any, str], Block], shape: Callable[[native.Rendered, str], dict[str, Any]],
          arguments_field: str) -> Response:
    grant = authenticate()
    blocks, single = _blocks(parse_block)
    header = request.headers.getlist("Idempotency-Key")
    header_key = parse_key(header) if header else None
    plans = [calls.plan(block.name, block.arguments, grant, _key(block, header_key, index, single),
                        calls.call_id_for(block.id), arguments_field, block.arguments_error)
             for index, block in enumerate(blocks)]
    rt = runtime()
    if len(plans) == 1:
        rendered = [_run(rt, plans[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(len(plans), PARALLEL)) as pool:
            futures = [pool.submit(_run, rt, plan) for plan in plans]
        rendered = [future.result() for future in futures]  # the first service failure raises
    answers = [shape(result, block.id) for result, block in zip(rendered, blocks)]
    return json_response(json.dumps(answers[0] if single else answers, ensure_ascii=False, separators=(",", ":")))


@bp.post("/v1/tool-use")
def anthropic() -> Response:
    return serve(anthropic_block, native.Rendered.anthropic, "/input")


@bp.post("/v1/openai/tool-calls")
def openai() -> Response:
    return serve(openai_block, native.Rendered.openai, "/function/arguments")

