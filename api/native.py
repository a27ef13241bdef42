"""What a model reads back: a call's outcome (or a refusal it can correct) as content blocks.

One rendering, two wire shapes: Anthropic's `tool_result` (a list of text blocks) and OpenAI's
`role: tool` message (one text). Output keeps every byte: a file's text, a command's stdout and
its stderr each travel as their own block, exactly as produced; what is not UTF-8 travels as
base64, and a status line (last) says so, names the exit code, and says where the rest of a long
output is. Nothing is trimmed, normalised or joined inside a block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.errors import RunwardenError, Unavailable
from shared.keys import Status
from shared.records import TaskView

# Refusals the model can correct by changing its call: answered as `is_error` results, with a hint.
MODEL_CORRECTABLE = {
    "schema_invalid": "Fix the tool input to match the tool's input_schema and call again.",
    "path_forbidden": "This path is outside what you may touch (or is not a regular file): use another path.",
    "command_forbidden": "Use only the programs you are allowed to run, without variable assignments.",
    "base_sha_mismatch": "The file changed since you read it. Read the file again, then write the patch "
                         "against its current content with base_sha set to its current sha.",
    "patch_does_not_apply": "The diff does not apply to the file as it is. Read the file again and send a "
                            "unified diff of exactly its current lines.",
    "file_not_found": "There is no such file. Check the path (list the directory with a shell command), or "
                      "create the file with apply_file_patch and base_sha of forty zeros.",
    "idempotency_key_reused": "This tool call id was already used for a different call: use a new id.",
}

# Failures of the service, not of the call: they stay HTTP problems (503), as on every endpoint.
SERVICE_FAILURES = frozenset({"unavailable", "sandbox_unavailable", "internal_error"})


@dataclass
class Rendered:
    """Text blocks in order, and whether the model should read them as a failure."""

    texts: list[str] = field(default_factory=list)
    is_error: bool = False

    def anthropic(self, tool_use_id: str) -> dict[str, Any]:
        content = [{"type": "text", "text": text} for text in self.texts]
        return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, "is_error": self.is_error}

    def openai(self, tool_call_id: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": tool_call_id, "content": "\n".join(self.texts)}


def refusal(error: RunwardenError) -> Rendered:
    """A refusal the model can correct (see MODEL_CORRECTABLE), as an error result."""
    return _failure(error.code, error.detail, error.extra)


def outcome(view: TaskView | None, task_id: str, stream_url: str | None) -> Rendered:
    """A call's final record as the model's result; raises for failures that are the service's."""
    if view is None or not view.status.terminal:
        where = f" Follow it at {stream_url}." if stream_url else ""
        return Rendered([f"The call has not finished yet (task_id {task_id}).{where} "
                         "Ask for its result later; do not send it again with a new id."], is_error=True)
    result = view.result or {}
    if view.status is Status.FAILED and result.get("code") in SERVICE_FAILURES:
        raise Unavailable(result.get("message") or "The call could not run; retry shortly.")
    if view.status is Status.COMPLETED and view.tool_name == "read_file":
        return _file(result)
    if view.status is Status.COMPLETED and "exit_code" not in result:
        return Rendered([_patch_line(result)])
    if "exit_code" in result:
        return _shell(view.status, result, task_id, stream_url)
    return _failure(result.get("code", view.status.value), result.get("message", ""), result)


def _failure(code: str, message: str, extra: dict[str, Any]) -> Rendered:
    lines = [f"Error {code}: {message}"]
    if extra.get("failed_index") is not None:  # a patch set: one entry failed, none was applied
        where = f" ({extra['path']})" if extra.get("path") else ""
        lines.append(f"Entry {extra['failed_index']}{where} of the patch set failed; no file was changed.")
    if code == "base_sha_mismatch" and extra.get("current_sha"):
        lines.append(f"The file's current sha is {extra['current_sha']}.")
    for error in extra.get("errors") or []:
        lines.append(f"At {error.get('pointer') or '/'}: {error.get('message')}")
    if hint := MODEL_CORRECTABLE.get(code):
        lines.append(hint)
    elif code in ("cancelled", "worker_lost"):
        lines.append("The call did not complete; send it again with a new id if it is still needed.")
    return Rendered([" ".join(lines)], is_error=True)


def _file(result: dict[str, Any]) -> Rendered:
    encoding = result.get("encoding", "utf-8")
    note = " It is not UTF-8 text: the block above is its bytes in base64." if encoding == "base64" else ""
    status = (f"read_file {result.get('path')}: {result.get('size')} bytes, sha {result.get('sha')}."
              f"{note} To patch it, send apply_file_patch with base_sha {result.get('sha')}.")
    return Rendered([result.get("content", ""), status] if result.get("content") else [status])


def _patch_line(result: dict[str, Any], dry_run: bool = False) -> str:
    if "files" in result:  # a patch set
        lines = [_patch_line(entry, bool(result.get("dry_run"))) for entry in result["files"]]
        head = ("Dry run: every entry applies; nothing was written." if result.get("dry_run")
                else f"All {len(lines)} files changed as one.")
        return " ".join([head, *lines])
    verb = "deleted" if result.get("deleted") else "created" if result.get("created") else "patched"
    if dry_run:
        return f"would be {verb}: {result.get('path')}, new sha {result.get('new_sha')}."
    return f"{verb} {result.get('path')}: new sha {result.get('new_sha')} (the base_sha of your next patch)."


def _shell(status: Status, result: dict[str, Any], task_id: str, stream_url: str | None) -> Rendered:
    rendered, notes = Rendered(), []
    for stream in ("stdout", "stderr"):
        text = result.get(stream) or ""
        if text:
            rendered.texts.append(text)
            base64 = " (not UTF-8: that block is base64)" if result.get(f"{stream}_encoding") == "base64" else ""
            notes.append(f"{stream}: block {len(rendered.texts)}{base64}")
        if result.get(f"{stream}_truncated"):
            notes.append(f"{stream} was {result.get(f'{stream}_bytes')} bytes and only its start is here: the "
                         f"whole output is in the call's stream (task_id {task_id}, {stream_url})")
    exit_code = result.get("exit_code")
    ended = _how_it_ended(status, result)
    rendered.texts.append("; ".join([f"exit code {exit_code}", *ended, *(notes or ["no output"])]) + ".")
    rendered.is_error = (status is not Status.COMPLETED or exit_code != 0 or bool(result.get("timed_out"))
                         or result.get("termination") not in (None, "exited"))
    return rendered


def _how_it_ended(status: Status, result: dict[str, Any]) -> list[str]:
    """What ended the command, from its `termination` (for a result recorded before it existed,
    from the old flags), then what the command used where that was measured."""
    termination = result.get("termination") or _termination_of(status, result)
    peak, cpu_ms = result.get("peak_memory_bytes"), result.get("cpu_time_ms")
    ended = {
        "cancelled": "cancelled",
        "timed_out": "killed: timed out (it ran past timeout_ms)",
        "output_capped": "stopped: its output passed the output cap",
        "oom_killed": "killed: out of memory" + (f" (peak {_bytes(peak)})" if peak is not None else ""),
        "signaled": f"killed by {result.get('signal') or 'a signal'}",
    }.get(termination)
    used = [] if peak is None or termination == "oom_killed" else [f"peak memory {_bytes(peak)}"]
    used += [] if cpu_ms is None else [f"cpu time {cpu_ms} ms"]
    return ([ended] if ended else []) + ([", ".join(used)] if used else [])


def _termination_of(status: Status, result: dict[str, Any]) -> str:
    if status is Status.CANCELLED:
        return "cancelled"
    if result.get("timed_out"):
        return "timed_out"
    if result.get("truncated"):
        return "output_capped"
    return "signaled" if result.get("signal") else "exited"


def _bytes(count: int) -> str:
    """1.0 GiB, 12.5 MiB, 900 KiB: what a person reads at a glance."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"
