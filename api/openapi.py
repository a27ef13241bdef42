"""The OpenAPI 3.1 document served at `GET /openapi.json`, built from the same schemas the API
validates with, so it cannot drift from the code (tests/test_openapi.py checks the routes too)."""
from __future__ import annotations

from typing import Any

from shared.idempotency import KEY_RE
from shared.paths import NAME_RE
from shared.schema import TOOLS, whole
from shared.workspaces import GIT_SOURCE_SCHEMA

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
        "member": {"type": ["string", "null"]},
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


_JSON_RPC = {  # what /mcp answers: a JSON-RPC response or error
    "type": "object",
    "required": ["jsonrpc"],
    "properties": {
        "jsonrpc": {"const": "2.0"}, "id": {"type": ["string", "integer", "null"]}, "result": {"type": "object"},
        "error": {"type": "object", "required": ["code", "message"],
                  "properties": {"code": {"type": "integer"}, "message": {"type": "string"}, "data": {}}},
    },
}
_MCP_METHODS = ["initialize", "ping", "tools/list", "tools/call", "notifications/initialized",
                "notifications/cancelled"]


def _mcp() -> dict[str, Any]:
    message = {"type": "object", "required": ["jsonrpc", "method"],
               "properties": {"jsonrpc": {"const": "2.0"}, "id": {"type": ["string", "integer"]},
                              "method": {"type": "string", "enum": _MCP_METHODS}, "params": {"type": "object"}}}
    either = {"application/json": {"schema": _JSON_RPC}, "application/problem+json": {"schema": _PROBLEM}}
    return {"post": {
        "operationId": "mcp", "security": [{"bearer": []}],
        "description": "The Model Context Protocol's Streamable HTTP transport, stateless (protocol 2025-11-25; "
                       "2025-06-18 and 2025-03-26 too): one JSON-RPC message per POST. GET and DELETE answer 405.",
        "parameters": [
            {"name": "MCP-Protocol-Version", "in": "header", "required": False, "schema": {"type": "string"}},
            {"name": "Idempotency-Key", "in": "header", "required": False,
             "schema": {"type": "string", "pattern": KEY_RE.pattern}},
        ],
        "requestBody": {"required": True, "content": {"application/json": {"schema": message}}},
        "responses": {
            "200": {"description": "the JSON-RPC response; for a shell tools/call with a progress token, an SSE "
                                   "stream of notifications/progress ending with it",
                    "content": {"application/json": {"schema": _JSON_RPC},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "202": {"description": "a notification (or a client's response): accepted, no body"},
            "400": {"description": "a body that is not one JSON-RPC message (a JSON-RPC error), or a bad "
                                   "Idempotency-Key (a problem)", "content": either},
            **_problems(401, 403, 413, 415, 429, 503),
        },
    }}


_AUDIT_RECORD = {"type": "object", "required": ["time", "tenant", "task_id", "tool", "outcome"],
                 "properties": {"time": {"type": "string"}, "tenant": {"type": "string"}, "run_id": {"type": "string"},
                                "sub": {"type": "string"}, "jti": {"type": ["string", "null"]},
                                "task_id": {"type": "string"}, "call_id": {"type": "string"},
                                "tool": {"type": "string"}, "path": {"type": ["string", "null"]},
                                "command": {"type": ["string", "null"]},
                                "idempotency_key": {"type": "string"}, "outcome": _STATUS,
                                "exit_code": {"type": ["integer", "null"]}, "error": {"type": ["string", "null"]},
                                "duration_ms": {"type": ["integer", "null"]},
                                "queue_wait_ms": {"type": ["integer", "null"]}}}


def _audit() -> dict[str, Any]:
    return {"get": {
        "operationId": "auditTrail", "security": [{"bearer": []}],
        "description": "The token's tenant's audit trail (scope audit:read): one JSON object a line per ended "
                       "call, oldest first. Each line is an audit record: " + ", ".join(_AUDIT_RECORD["properties"]),
        "parameters": [
            {"name": "since", "in": "query", "required": False,
             "description": "an ISO 8601 time, or a number of seconds before now",
             "schema": {"type": "string", "maxLength": 64}},
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": 10000, "default": 1000}},
        ],
        "responses": {"200": {"description": "JSON lines", "content": {"application/x-ndjson": {
                                  "schema": {"type": "string"}}}},
                      **_problems(400, 401, 403, 503)},
    }}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _problems(*codes: int) -> dict[str, Any]:
    return {str(code): {"description": "problem", "content": {"application/problem+json": {"schema": _PROBLEM}}}
            for code in codes}


_TIME = {"type": "string", "format": "date-time"}
_WORKSPACE = {"type": "object", "required": ["run_id", "bytes", "files", "created", "last_used", "node"],
              "properties": {"run_id": {"type": "string"}, "bytes": {"type": "integer"}, "files": {"type": "integer"},
                             "created": _TIME, "last_used": _TIME, "node": {"type": ["string", "null"]}}}
_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _workspaces(auth: list[dict[str, list[str]]]) -> dict[str, Any]:
    """Contract section 11: the tenant's workspaces, for a token with `workspaces:admin`."""
    run_id = {"name": "run_id", "in": "path", "required": True,
              "schema": {"type": "string", "pattern": whole(NAME_RE.pattern[1:-1]), "maxLength": 64}}
    replace = {"name": "replace", "in": "query", "required": False, "schema": {"type": "string", "enum": ["true", "false"]}}
    created = {"type": "object", "required": ["run_id", "files", "bytes"],
               "properties": {"run_id": {"type": "string"}, "files": {"type": "integer"}, "bytes": {"type": "integer"}}}
    return {
        "/v1/workspaces": {"get": {
            "operationId": "listWorkspaces", "security": auth,
            "responses": {"200": _json({"type": "object", "required": ["workspaces"],
                                        "properties": {"workspaces": {"type": "array", "items": _WORKSPACE}}},
                                       "the tenant's workspaces, by run_id"), **_problems(401, 403, 503)},
        }},
        "/v1/workspaces/{run_id}": {
            "put": {
                "operationId": "createWorkspace", "security": auth, "parameters": [run_id, replace],
                "description": "No body: an empty workspace. A tar or gzipped tar: extracted. JSON: a git clone.",
                "requestBody": {"required": False, "content": {
                    "application/x-tar": _BINARY, "application/gzip": _BINARY,
                    "application/json": {"schema": GIT_SOURCE_SCHEMA}}},
                "responses": {"201": _json(created, "created"),
                              **_problems(400, 401, 403, 404, 408, 409, 413, 415, 422, 503)},
            },
            "delete": {"operationId": "deleteWorkspace", "security": auth, "parameters": [run_id],
                       "responses": {"204": {"description": "deleted"}, **_problems(400, 401, 403, 404, 409, 503)}},
        },
    }


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
            "/mcp": _mcp(),
            "/v1/admin/revocations": {"post": {
                "operationId": "revokeToken", "security": auth,
                "description": "Revoke one of the token's own tenant's tokens by jti (scope tenant:admin); "
                               "its open streams close with 4401 within 2 s.",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["jti"], "additionalProperties": False,
                    "properties": {"jti": {"type": "string", "minLength": 1, "maxLength": 256}}}}}},
                "responses": {"200": _json({"type": "object", "required": ["jti", "tenant", "revoked"],
                                            "properties": {"jti": {"type": "string"}, "tenant": {"type": "string"},
                                                           "revoked": {"type": "boolean"},
                                                           "expires_in": {"type": "integer"}}}, "revoked"),
                              **_problems(400, 401, 403, 413, 415, 503)},
            }},
            "/v1/audit": _audit(),
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
            **_workspaces(auth),
        },
    }
