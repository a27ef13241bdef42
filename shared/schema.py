"""The tool-call envelope and each tool's parameter schema, and how the API reads JSON.

`tool_name` selects the parameter schema (a `oneOf` over shapes would not bind them), formats are
asserted with a FormatChecker, and every object is closed with `additionalProperties: false`.
"""
from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from shared.errors import SchemaInvalid
from shared.keys import FILE_QUEUE, SHELL_QUEUE

MAX_PATH = 4096
MAX_DIFF = 1024 * 1024
MAX_COMMAND = 65536
# What a stream's client may send to a running command (`{"type": "signal", "signal": "SIGINT"}`).
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL, "SIGHUP": signal.SIGHUP}


def whole(regex: str) -> str:
    r"""A JSON Schema `pattern` for `regex` over the whole string, with one meaning in ECMA-262 and in
    Python's `re.search` (which jsonschema uses): there `$` also matches before a final newline, so
    `^[0-9a-f]{40}$` would accept a SHA followed by "\n". `(?!\n)` after the `$` rules that out."""
    return f"^(?:{regex})$(?!\\n)"


_PATH = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_PATH,
    "description": "Relative POSIX path inside the run's workspace (no leading '/', no '..').",
}
_SHA1 = {"type": "string", "pattern": "^[0-9a-f]{40}$"}
_SHA256 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}


def _stream_fields(name: str) -> dict[str, Any]:
    """What a shell result says of one output stream (workers/relay.py `StreamCopy.result_fields`)."""
    return {
        name: {"type": "string", "description": f"The {name} bytes (their start when {name}_truncated): "
                                                f"UTF-8 text, or base64 when {name}_encoding says so."},
        f"{name}_encoding": {"type": "string", "enum": ["utf-8", "base64"]},
        f"{name}_bytes": {"type": "integer", "minimum": 0, "description": f"Size of the whole {name}."},
        f"{name}_sha256": {**_SHA256, "description": f"sha256 of the whole {name}."},
        f"{name}_truncated": {"type": "boolean", "description": "Only the start is here; the stream has it all."},
    }


MAX_PATCHES = 64
_DIFF = {"type": "string", "minLength": 1, "maxLength": MAX_DIFF, "description": "Unified diff of this one file."}
_BASE_SHA = {"type": "string", "pattern": whole("[0-9a-f]{40}"), "minLength": 40, "maxLength": 40,
             "description": "git blob SHA-1 of the file the diff was written against."}
_PATCH = {
    "type": "object",
    "properties": {"path": _PATH, "diff": _DIFF, "base_sha": _BASE_SHA},
    "required": ["path", "diff", "base_sha"],
    "additionalProperties": False,
}

_PATCH_RESULT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "base_sha": _SHA1,
        "new_sha": {**_SHA1, "description": "The file's sha now (forty zeros once deleted)."},
        "created": {"type": "boolean"},
        "deleted": {"type": "boolean"},
    },
    "required": ["path", "base_sha", "new_sha", "created", "deleted"],
}


@dataclass(frozen=True)
class Tool:
    """A tool as every surface and both sides see it: who may call it, where it runs, its schema."""

    name: str
    scope: str
    queue: str
    streams: bool  # a shell call: answered 202 with a stream, its output relayed live
    description: str
    parameters: dict[str, Any]
    # The `result` of a completed call (`GET /v1/tool-calls/{id}`), as JSON Schema: MCP's outputSchema.
    # Open (no additionalProperties: false), so a field added later does not break a client's check.
    result: dict[str, Any]
    read_only: bool = False  # it never changes the workspace (MCP readOnlyHint; else destructiveHint)
    idempotent: bool = False  # sent again with the same arguments, it changes nothing more (idempotentHint)

    @property
    def task_name(self) -> str:
        """The Celery task that runs it."""
        return f"runwarden.{self.name}"

    def with_defaults(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """The parameters with every default of the schema filled in."""
        defaults = {name: spec["default"] for name, spec in self.parameters["properties"].items()
                    if "default" in spec}
        return defaults | parameters


TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool(
            name="read_file",
            scope="files:read",
            queue=FILE_QUEUE,
            streams=False,
            description=(
                "Read one file of the workspace (a path relative to it, such as src/app.py). Returns its "
                "exact bytes (as UTF-8 text, or base64 when they are not UTF-8), its size and its sha: the "
                "git blob SHA-1 of its bytes. Keep that sha: it is the base_sha apply_file_patch needs to "
                "change this file. Paths outside what your token grants are refused. Answers within seconds; "
                "sending the same call again (same id or Idempotency-Key) is safe."
            ),
            parameters={
                "type": "object",
                "properties": {"path": _PATH},
                "required": ["path"],
                "additionalProperties": False,
            },
            result={
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "sha": {**_SHA1, "description": "git blob SHA-1 of the bytes: the base_sha of a patch."},
                    "size": {"type": "integer", "minimum": 0},
                    "encoding": {"type": "string", "enum": ["utf-8", "base64"]},
                    "content": {"type": "string", "description": "The bytes, as `encoding` says."},
                },
                "required": ["path", "sha", "size", "encoding", "content"],
            },
            read_only=True,
        ),
        Tool(
            name="apply_file_patch",
            scope="files:write",
            queue=FILE_QUEUE,
            streams=False,
            description=(
                "Change one file by a unified diff (like `diff -u` or `git diff` of that one file), applied "
                "exactly as written: no fuzz, whitespace and line endings kept. It applies only if the file "
                "is still the version you read: base_sha must be the sha read_file returned (forty zeros: "
                "create a file that must not exist yet; a diff to '+++ /dev/null' deletes the file). If the "
                "file changed since, the call is refused with the current sha: read the file again and "
                "write the diff against what it holds now. The result's new_sha is the base_sha of your "
                "next patch to it. The file is replaced atomically. Answers within seconds; sending the "
                "same call again (same id or Idempotency-Key) is safe: it is never applied twice."
            ),
            parameters=_PATCH,
            result=_PATCH_RESULT,
            idempotent=True,
        ),
        Tool(
            name="apply_file_patches",
            scope="files:write",
            queue=FILE_QUEUE,
            streams=False,
            description=(
                "Apply unified diffs to several files as one change, all or nothing: either every file "
                "ends at its new_sha or none changes, even if the worker dies midway. Use it instead of "
                "several apply_file_patch calls when the changes belong together (a rename across files, "
                "an interface and its callers). Each entry is one file's diff and the base_sha it was "
                "written against (forty zeros: create; '+++ /dev/null': delete); each path once. If an "
                "entry fails (its file changed: base_sha_mismatch with current_sha; patch_does_not_apply; "
                "path_forbidden; file_not_found), nothing is written and the error names failed_index, "
                "the entry's position. dry_run: true checks every entry and writes nothing."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "patches": {"type": "array", "minItems": 1, "maxItems": MAX_PATCHES, "items": _PATCH,
                                "description": "The files' diffs, applied in this order; each path once."},
                    "dry_run": {"type": "boolean", "default": False,
                                "description": "Check every entry and answer what would happen; write nothing."},
                },
                "required": ["patches"],
                "additionalProperties": False,
            },
            result={
                "type": "object",
                "properties": {
                    "dry_run": {"type": "boolean"},
                    "files": {"type": "array", "items": _PATCH_RESULT,
                              "description": "Per entry, in order: what it did (or, dry run, would do)."},
                },
                "required": ["dry_run", "files"],
            },
            idempotent=True,
        ),
        Tool(
            name="execute_shell_command",
            scope="shell:exec",
            queue=SHELL_QUEUE,
            streams=True,
            description=(
                "Run a bash command in a fresh sandbox whose working directory is the workspace. "
                "The command sees only what the token's allowed_paths grant: for each pattern, its "
                "directory prefix up to the first wildcard (docs/** and docs/*.md show docs/, read-write); "
                "a pattern with a wildcard in its first segment (**, *.md) shows the whole workspace, "
                "and the rest of the workspace root is absent and read-only. "
                "No network unless the token allows it; programs and libraries of the system read-only; "
                "a private /tmp; nothing survives the call but the workspace. "
                "Output streams over WebSocket; the result holds the exit code, stdout and stderr exactly "
                "as written (the first 1 MiB of each in the result, all of it in the stream) with their byte "
                "counts and sha256. A non-zero exit code is the command's own result (a failing test, say), "
                "not a failure of the tool: read its output. Output past 64 MiB stops the command. "
                "The call lasts as long as the command, at most timeout_ms (default 30 s, at most 60 s), "
                "after which it is killed: keep timeout_ms below your client's own request timeout. "
                "Sending the same call again (same id or Idempotency-Key) never runs it twice: it answers "
                "the first run's result."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "command": {"type": "string", "minLength": 1, "maxLength": MAX_COMMAND, "pattern": whole("[^\\x00]*"),
                                "description": "Command line run with bash -c (no NUL byte)."},
                    "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 60000, "default": 30000,
                                   "description": "Wall-clock limit; the command gets SIGTERM then SIGKILL."},
                    "cwd": {**_PATH, "description": "Working directory relative to the workspace."},
                },
                "required": ["command"],
                "additionalProperties": False,
            },
            result={
                "type": "object",
                "properties": {
                    "exit_code": {"type": "integer", "description": "128+N when signal N ended the command."},
                    "signal": {"type": ["string", "null"], "description": "The ending signal's name, or null."},
                    "timed_out": {"type": "boolean"},
                    "truncated": {"type": "boolean", "description": "The output cap stopped the command."},
                    "duration_ms": {"type": "integer", "minimum": 0},
                    **_stream_fields("stdout"),
                    **_stream_fields("stderr"),
                },
                "required": ["exit_code", "signal", "timed_out", "duration_ms", "stdout", "stderr",
                             "stdout_bytes", "stderr_bytes", "stdout_sha256", "stderr_sha256"],
            },
        ),
    )
}

ENVELOPE: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "tool_name": {"type": "string", "enum": sorted(TOOLS)},
        "call_id": {"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36},
        "parameters": {"type": "object"},
    },
    "required": ["tool_name", "call_id", "parameters"],
    "additionalProperties": False,
}

_FORMATS = Draft202012Validator.FORMAT_CHECKER
_ENVELOPE_VALIDATOR = Draft202012Validator(ENVELOPE, format_checker=_FORMATS)
_PARAMETER_VALIDATORS = {
    name: Draft202012Validator(tool.parameters, format_checker=_FORMATS) for name, tool in TOOLS.items()
}


@dataclass(frozen=True)
class ToolCall:
    tool_name: str
    call_id: str
    parameters: dict[str, Any]

    @property
    def tool(self) -> Tool:
        return TOOLS[self.tool_name]


def _pointer(path: Any, prefix: str = "") -> str:
    return prefix + "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


def loads(text: bytes | str) -> Any:
    """JSON as the API reads every body: UTF-8 text, no lone surrogate, no object with a key twice.

    RFC 8259 leaves a repeated key to the parser, and Python's keeps the last one, so
    `{"tool_name": "read_file", "tool_name": "execute_shell_command"}` would run what a reader of
    the first key (a proxy, an audit, a reviewer) does not expect: refused, with each pointer."""
    repeated: dict[int, tuple[dict[str, Any], str]] = {}  # holding each object keeps its id its own

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) < len(pairs):  # rare: only then look for the key
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    repeated[id(obj)] = (obj, key)
                    break
                seen.add(key)
        return obj

    try:
        body = json.loads(text, object_pairs_hook=no_repeats)
        # A lone surrogate ("\ud800") is valid JSON but no file name, command or output can hold it.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError):
        raise SchemaInvalid("The body is not valid JSON of UTF-8 text.",
                            errors=[{"pointer": "", "message": "invalid JSON"}]) from None
    if repeated:
        raise SchemaInvalid("The body has an object with the same key twice.", errors=_repeated_keys(body, repeated))
    return body


def _repeated_keys(body: Any, repeated: dict[int, tuple[dict[str, Any], str]]) -> list[dict[str, str]]:
    """The pointer of each repeated member still in `body` (one inside a value that a repeat
    replaced is gone, but its parent is reported)."""
    keys = {marked: key for marked, (_, key) in repeated.items()}
    errors, pending = [], [("", body)]
    while pending:  # a loop, not recursion: the body may nest as deep as json.loads allows
        pointer, node = pending.pop()
        if isinstance(node, dict):
            if id(node) in keys:
                key = keys[id(node)]
                errors.append({"pointer": _pointer([key], pointer), "message": f"duplicate key {key[:100]!r}"})
            pending.extend((_pointer([key], pointer), value) for key, value in node.items())
        elif isinstance(node, list):
            pending.extend((f"{pointer}/{index}", value) for index, value in enumerate(node))
    return sorted(errors, key=lambda error: error["pointer"])[:20]


def _errors(validator: Draft202012Validator, instance: Any, prefix: str = "") -> list[dict[str, str]]:
    return [
        {"pointer": _pointer(error.absolute_path, prefix), "message": error.message[:300]}
        for error in sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    ]


def parse_tool_call(body: Any) -> ToolCall:
    """Validate the envelope, then the parameters against the schema `tool_name` selects."""
    errors = _errors(_ENVELOPE_VALIDATOR, body)
    tool_name = body.get("tool_name") if isinstance(body, dict) else None
    if isinstance(tool_name, str) and tool_name in TOOLS and isinstance(body.get("parameters"), dict):
        errors += _errors(_PARAMETER_VALIDATORS[body["tool_name"]], body["parameters"], "/parameters")
    if errors:
        raise SchemaInvalid("The tool call does not match its schema.", errors=errors)
    tool = TOOLS[body["tool_name"]]
    return ToolCall(tool.name, body["call_id"], tool.with_defaults(body["parameters"]))


def tool_definitions() -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in TOOLS.values()]


def openai_tools() -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in TOOLS.values()
    ]
