"""What calls return: frozen dataclasses with the contract's fields (sections 2 and 5).

Bytes stay bytes: a file's content and a command's output are decoded exactly once from what
travelled (`data` as UTF-8, `data_b64` / base64 decoded) and never turned back into text here.
"""
from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ZERO_SHA = "0" * 40  # as base_sha: the file must not exist yet (creation)


def blob_sha(data: bytes) -> str:
    """The git blob SHA-1 of `data`, what `git hash-object FILE` prints and `base_sha` expects."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def wire_bytes(text: str, encoding: str) -> bytes:
    """The bytes a JSON string stands for: UTF-8 text, or base64 when the bytes were not UTF-8."""
    return base64.b64decode(text, validate=True) if encoding == "base64" else text.encode("utf-8")


@dataclass(frozen=True)
class FileResult:
    task_id: str
    call_id: str
    path: str
    sha: str
    size: int
    encoding: str  # how the content travelled: "utf-8" or "base64"
    content: bytes
    replayed: bool = False  # the answer was a replay of an earlier request with the same key

    @property
    def text(self) -> str:
        return self.content.decode("utf-8")


@dataclass(frozen=True)
class PatchResult:
    task_id: str
    call_id: str
    path: str
    base_sha: str
    new_sha: str
    created: bool
    deleted: bool
    replayed: bool = False


@dataclass(frozen=True)
class FileChange:
    """One entry of a patch set's result, in the order the entries were given."""

    path: str
    base_sha: str
    new_sha: str
    created: bool
    deleted: bool


@dataclass(frozen=True)
class PatchSetResult:
    """`apply_patches`: every file is at its `new_sha` now, or (`dry_run`) would be."""

    task_id: str
    call_id: str
    dry_run: bool
    files: tuple[FileChange, ...]
    replayed: bool = False


@dataclass(frozen=True)
class Output:
    """One output event: a piece of stdout or stderr, in order, never a split UTF-8 character."""

    seq: int
    stream: str  # "stdout" or "stderr"
    data: bytes


@dataclass(frozen=True)
class Exit:
    """The last event of every stream. Fields a call that never ran cannot know are None."""

    seq: int
    status: str
    exit_code: int | None  # 128+N when signal N ended the command
    signal: str | None
    timed_out: bool
    duration_ms: int | None
    stdout_bytes: int | None
    stderr_bytes: int | None
    stdout_sha256: str | None
    stderr_sha256: str | None
    truncated: bool
    termination: str | None = None
    peak_memory_bytes: int | None = None
    cpu_time_ms: int | None = None


Event = Output | Exit


def _summary(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields an exit event and a shell result share."""
    return {
        "exit_code": fields.get("exit_code"), "signal": fields.get("signal"),
        "timed_out": bool(fields.get("timed_out")), "duration_ms": fields.get("duration_ms"),
        "stdout_bytes": fields.get("stdout_bytes"), "stderr_bytes": fields.get("stderr_bytes"),
        "stdout_sha256": fields.get("stdout_sha256"), "stderr_sha256": fields.get("stderr_sha256"),
        "truncated": bool(fields.get("truncated")), "termination": fields.get("termination"),
        "peak_memory_bytes": fields.get("peak_memory_bytes"), "cpu_time_ms": fields.get("cpu_time_ms"),
    }


def parse_event(message: Mapping[str, Any]) -> Event | None:
    """An event from its JSON frame; None for a type this client does not know."""
    if message.get("type") == "output":
        data = message["data"].encode("utf-8") if "data" in message else base64.b64decode(message["data_b64"])
        return Output(seq=int(message["seq"]), stream=str(message["stream"]), data=data)
    if message.get("type") == "exit":
        return Exit(seq=int(message["seq"]), status=str(message.get("status", "completed")), **_summary(message))
    return None


@dataclass(frozen=True)
class ShellResult:
    task_id: str
    call_id: str
    status: str  # completed, cancelled or lost (failed raises CallFailed)
    exit_code: int | None
    signal: str | None
    timed_out: bool
    duration_ms: int | None
    stdout: bytes
    stderr: bytes
    stdout_bytes: int | None  # as the server counted them (== len(stdout) unless truncated)
    stderr_bytes: int | None
    stdout_sha256: str | None
    stderr_sha256: str | None
    truncated: bool  # the output cap stopped the command
    termination: str | None = None
    peak_memory_bytes: int | None = None
    cpu_time_ms: int | None = None
    replayed: bool = False

    @staticmethod
    def from_exit(task_id: str, call_id: str, exit: Exit, stdout: bytes, stderr: bytes,
                  replayed: bool = False) -> ShellResult:
        fields = {name: getattr(exit, name) for name in _summary({})}
        return ShellResult(task_id=task_id, call_id=call_id, status=exit.status, stdout=stdout, stderr=stderr,
                           replayed=replayed, **fields)

    @staticmethod
    def from_result(task_id: str, call_id: str, status: str, result: Mapping[str, Any], stdout: bytes,
                    stderr: bytes, replayed: bool = False) -> ShellResult:
        return ShellResult(task_id=task_id, call_id=call_id, status=status, stdout=stdout, stderr=stderr,
                           replayed=replayed, **_summary(result))


@dataclass(frozen=True)
class Task:
    """`GET /v1/tool-calls/{task_id}` (and `DELETE`): where a call stands."""

    task_id: str
    call_id: str
    tool_name: str
    status: str  # queued, running, completed, failed, cancelled, lost
    result: Mapping[str, Any] | None

    @property
    def finished(self) -> bool:
        return self.status not in ("queued", "running")
