"""The OpenAPI 3.1 document served at `GET /openapi.json`, built from the same schemas the API
validates with, so it cannot drift from the code (tests/test_openapi.py checks the routes too)."""
from __future__ import annotations

from typing import Any

from shared.idempotency import KEY_RE
from shared.schema import TOOLS, whole

_PROBLEM = {
    "type": "object",
    "required": ["type", "title", "status", "code", "detail"],
    "properties": {
        "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
        "code": {"type": "string"}, "detail": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object", "properties": {
            "pointer": {"type": "string"}, "message": {"type": "string"}}}},
        "task_id": {"type": "string"}, "call_id": {"type": "string"}, "tool_name": {"type": "string"},
        "current_sha": {"type": "string"}, "stream_url": {"type": "string"},
        "path": {"type": "string"}, "failed_index": {"type": "integer", "minimum": 0},  # a patch set's entry
    },
}
_STATUS = {"type": "string", "enum": ["queued", "running", "completed", "failed", "cancelled", "lost"]}
_TASK = {
    "type": "object",
    "required": ["task_id", "call_id", "tool_name", "status", "result"],
    "properties": {"task_id": {"type": "string"}, "call_id": {"type": "string"}, "tool_name": {"type": "string"},
                   "status": _STATUS, "result": {}, "stream_url": {"type": "string"}},
}
_ACCEPTED = {
    "type": "object",
    "required": ["task_id", "call_id", "tool_name", "status"],
    "properties": {"task_id": {"type": "string"}, "call_id": {"type": "string"}, "tool_name": {"type": "string"},
                   "status": _STATUS, "stream_url": {"type": "string"}},
}


_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TOOL_USE = {"type": "object", "required": ["type", "id", "name", "input"],
             "properties": {"type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1, "maxLength": 256},
                            "name": {"type": "string", "maxLength": 256}, "input": {"type": "object"}}}
_TOOL_RESULT = {"type": "object", "required": ["type", "tool_use_id", "content", "is_error"],
                "properties": {"type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
                               "content": {"type": "array", "items": _TEXT_BLOCK}, "is_error": {"type": "boolean"}}}
_OPENAI_CALL = {"type": "object", "required": ["id", "type", "function"],
                "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 256}, "type": {"const": "function"},
                               "function": {"type": "object", "required": ["name", "arguments"],
                                            "properties": {"name": {"type": "string", "maxLength": 256},
                                                           "arguments": {"type": "string", "maxLength": 65536}}}}}
_OPENAI_MESSAGE = {"type": "object", "required": ["role", "tool_call_id", "content"],
                   "properties": {"role": {"const": "tool"}, "tool_call_id": {"type": "string"},
                                  "content": {"type": "string"}}}
MAX_BLOCKS = 64  # as api/routes/tool_use.py


def _one_or_many(schema: dict[str, Any]) -> dict[str, Any]:
    return {"oneOf": [schema, {"type": "array", "minItems": 1, "maxItems": MAX_BLOCKS, "items": schema}]}


def _model_native(operation_id: str, block: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A model-native endpoint (contract section 8): the optional key, one block or a turn's array."""
    return {"post": {
        "operationId": operation_id, "security": [{"bearer": []}],
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                        "schema": {"type": "string", "pattern": KEY_RE.pattern}}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _one_or_many(block)}}},
        "responses": {"200": _json(_one_or_many(answer), "the results, in the order sent"),
                      **_problems(400, 401, 403, 413, 415, 429, 503)},
    }}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _problems(*codes: int) -> dict[str, Any]:
    return {str(code): {"description": "problem", "content": {"application/problem+json": {"schema": _PROBLEM}}}
            for code in codes}


def tool_call_schema() -> dict[str, Any]:
    return {"oneOf": [
        {"type": "object", "required": ["tool_name", "call_id", "parameters"], "additionalProperties": False,
         "properties": {"tool_name": {"const": tool.name},
                        "call_id": {"type": "string", "format": "uuid"},
                        "parameters": tool.parameters}}
        for tool in TOOLS.values()
    ]}


def document() -> dict[str, Any]:
    auth: list[dict[str, list[str]]] = [{"bearer": []}]
    task_id = {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "runwarden", "version": "1",
                 "description": "Tool calls for AI coding agents. Shell output streams over the WebSocket at "
                                "/v1/tool-calls/{task_id}/stream (not described here: OpenAPI has no WebSockets)."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}}},
        "paths": {
            "/v1/tool-calls": {"post": {
                "operationId": "createToolCall", "security": auth,
                "parameters": [
                    {"name": "Idempotency-Key", "in": "header", "required": True,
                     "schema": {"type": "string", "pattern": KEY_RE.pattern}},
                    {"name": "Prefer", "in": "header", "required": False,
                     "schema": {"type": "string", "pattern": whole("wait=[0-9]{1,2}")}},
                ],
                "requestBody": {"required": True, "content": {"application/json": {"schema": tool_call_schema()}}},
                "responses": {"200": _json(_TASK, "the call's result"), "202": _json(_ACCEPTED, "accepted"),
                              **_problems(400, 401, 403, 404, 409, 412, 413, 415, 422, 429, 503)},
            }},
            "/v1/tool-calls/{task_id}": {
                "get": {"operationId": "getToolCall", "security": auth, "parameters": [task_id],
                        "responses": {"200": _json(_TASK, "the call"), **_problems(401, 404, 503)}},
                "delete": {"operationId": "cancelToolCall", "security": auth, "parameters": [task_id],
                           "responses": {"200": _json(_TASK, "cancelled or already ended"),
                                         "202": _json(_TASK, "cancellation under way"),
                                         **_problems(401, 403, 404, 503)}},
            },
            "/v1/tool-use": _model_native("toolUse", _TOOL_USE, _TOOL_RESULT),
            "/v1/openai/tool-calls": _model_native("openaiToolCalls", _OPENAI_CALL, _OPENAI_MESSAGE),
            "/v1/tools": {"get": {
                "operationId": "listTools", "security": [],
                "parameters": [{"name": "format", "in": "query", "required": False,
                                "schema": {"type": "string", "enum": ["openai"]}}],
                "responses": {"200": _json({"type": "object", "required": ["tools"],
                                            "properties": {"tools": {"type": "array"}}}, "tool definitions"),
                              **_problems(400)},
            }},
            "/healthz": {"get": {"operationId": "healthz", "security": [],
                                 "responses": {"200": _json({"type": "object"}, "alive")}}},
            "/readyz": {"get": {"operationId": "readyz", "security": [],
                                "responses": {"200": _json({"type": "object"}, "ready"), **_problems(503)}}},
            "/metrics": {"get": {"operationId": "metrics", "security": [], "responses": {"200": {
                "description": "Prometheus exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"operationId": "openapi", "security": [],
                                      "responses": {"200": _json({"type": "object"}, "this document")}}},
        },
    }
