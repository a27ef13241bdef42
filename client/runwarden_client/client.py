"""`Client`: runwarden's tool calls from Python, over its HTTP API (contract sections 2 and 4).

Every logical call gets one Idempotency-Key and one call_id, and every retry of it sends the same
bytes again, so a flaky network never runs a call twice: the server replays the first outcome.
"""
from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import requests

from runwarden_client.errors import (CallFailed, ConnectionFailed, IdempotencyKeyInUse, IntegrityError,
                                     RunwardenError)
from runwarden_client.results import (FileChange, FileResult, PatchResult, PatchSetResult, ShellResult, Task,
                                      blob_sha, wire_bytes)
from runwarden_client.retry import Budget, RetryPolicy, retry_after, retryable
from runwarden_client.stream import Stream, drain, send_signal
from runwarden_client.version import __version__

SHELL = "execute_shell_command"
DEFAULT_SHELL_TIMEOUT_MS = 30000
MAX_PREFER_WAIT_S = 60
WAIT_MARGIN_S = 5  # beyond the command's own timeout: queueing and the sandbox's start
_NETWORK_ERRORS = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


class _Call:
    """One logical tool call: its key, call_id and body, the same bytes on every retry."""

    def __init__(self, tool_name: str, parameters: dict[str, Any], key: str | None, call_id: str | None) -> None:
        self.tool_name = tool_name
        self.key = key or str(uuid.uuid4())
        self.call_id = call_id or str(uuid.uuid4())
        envelope = {"tool_name": tool_name, "call_id": self.call_id, "parameters": parameters}
        self.body = json.dumps(envelope, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class Client:
    """Calls for one token (one tenant's run). `timeout` bounds each HTTP request and each quiet
    stretch of a stream; `retries` and `retry_deadline` bound the tries and the waiting of one call."""

    def __init__(self, url: str, token: str, *, timeout: float = 30.0, retries: int = 6,
                 retry_deadline: float = 60.0, session: requests.Session | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.policy = RetryPolicy(attempts=retries, deadline_s=retry_deadline)
        self.session = session or requests.Session()
        self.authorization = f"Authorization: Bearer {token}"
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json",
                         "User-Agent": f"runwarden-client/{__version__}"}

    # -- the tools ------------------------------------------------------------------------------

    def read_file(self, path: str, *, idempotency_key: str | None = None, call_id: str | None = None) -> FileResult:
        call = _Call("read_file", {"path": path}, idempotency_key, call_id)
        body, replayed = self._file_call(call)
        result = body["result"]
        content = wire_bytes(result["content"], result["encoding"])
        if blob_sha(content) != result["sha"]:
            raise IntegrityError(0, "integrity_error", f"the content of {path} does not match its sha")
        return FileResult(task_id=body["task_id"], call_id=call.call_id, path=result["path"], sha=result["sha"],
                          size=result["size"], encoding=result["encoding"], content=content, replayed=replayed)

    def apply_patch(self, path: str, diff: str, *, base_sha: str | None = None, old_content: bytes | None = None,
                    idempotency_key: str | None = None, call_id: str | None = None) -> PatchResult:
        """Apply a unified diff to `path` if the file is still `base_sha` (or, given `old_content`, the
        bytes it had when the diff was made; `ZERO_SHA` to create it)."""
        sha = _base_sha(base_sha, old_content, "apply_patch")
        call = _Call("apply_file_patch", {"path": path, "diff": diff, "base_sha": sha}, idempotency_key, call_id)
        body, replayed = self._file_call(call)
        result = body["result"]
        return PatchResult(task_id=body["task_id"], call_id=call.call_id, path=result["path"],
                           base_sha=result["base_sha"], new_sha=result["new_sha"], created=result["created"],
                           deleted=result["deleted"], replayed=replayed)

    def apply_patches(self, patches: Sequence[Mapping[str, Any]], *, dry_run: bool = False,
                      idempotency_key: str | None = None, call_id: str | None = None) -> PatchSetResult:
        """Apply several unified diffs, all or nothing (contract section 13). Each entry has `path`,
        `diff`, and `base_sha` or `old_content`, as `apply_patch` takes them. A failing entry fails
        the whole call with its own error, whose `failed_index` is the entry's position."""
        entries = [{"path": entry["path"], "diff": entry["diff"],
                    "base_sha": _base_sha(entry.get("base_sha"), entry.get("old_content"), "each patch")}
                   for entry in patches]
        call = _Call("apply_file_patches", {"patches": entries, "dry_run": dry_run}, idempotency_key, call_id)
        body, replayed = self._file_call(call)
        result = body["result"]
        files = tuple(FileChange(path=f["path"], base_sha=f["base_sha"], new_sha=f["new_sha"], created=f["created"],
                                 deleted=f["deleted"]) for f in result["files"])
        return PatchSetResult(task_id=body["task_id"], call_id=call.call_id, dry_run=result["dry_run"], files=files,
                              replayed=replayed)

    def run(self, command: str, *, timeout_ms: int | None = None, cwd: str | None = None,
            idempotency_key: str | None = None, call_id: str | None = None) -> ShellResult:
        """Run a command to its end. A non-zero exit is a result, not an exception."""
        call = _Call(SHELL, _shell_parameters(command, timeout_ms, cwd), idempotency_key, call_id)
        wait_s = min(MAX_PREFER_WAIT_S, math.ceil((timeout_ms or DEFAULT_SHELL_TIMEOUT_MS) / 1000) + WAIT_MARGIN_S)
        response = self._request("POST", "/v1/tool-calls", call=call, headers={"Prefer": f"wait={wait_s}"},
                                 read_s=wait_s)
        body, replayed = response.json(), _replayed(response)
        if response.status_code == 200:
            done = _shell_result(body, replayed)
            if done is not None:
                return done
        # Accepted (202), still running (409), or too large to ride along: the stream has it all.
        stream = Stream(self, body["task_id"], call_id=call.call_id, replayed=replayed)
        exit = drain(stream)
        if exit.status == "failed":
            raise self._failure(body["task_id"])
        return ShellResult.from_exit(stream.task_id, call.call_id, exit, stream.stdout, stream.stderr, replayed)

    def stream(self, command: str | None = None, *, task_id: str | None = None, timeout_ms: int | None = None,
               cwd: str | None = None, after_seq: int = 0, idempotency_key: str | None = None,
               call_id: str | None = None) -> Stream:
        """The events of a new command (`command`) or of a call already made (`task_id`)."""
        if (command is None) == (task_id is None):
            raise TypeError("stream needs exactly one of command and task_id")
        if command is None:
            assert task_id is not None
            return Stream(self, task_id, after_seq=after_seq)
        call = _Call(SHELL, _shell_parameters(command, timeout_ms, cwd), idempotency_key, call_id)
        response = self._request("POST", "/v1/tool-calls", call=call)
        return Stream(self, response.json()["task_id"], call_id=call.call_id, after_seq=after_seq,
                      replayed=_replayed(response))

    def get(self, task_id: str) -> Task:
        return _task(self._request("GET", f"/v1/tool-calls/{quote(task_id, safe='')}").json())

    def cancel(self, task_id: str) -> Task:
        """Cancel a call: a queued one never starts, a running one is terminated."""
        return _task(self._request("DELETE", f"/v1/tool-calls/{quote(task_id, safe='')}").json())

    def signal(self, task_id: str, name: str) -> None:
        """Send SIGINT, SIGTERM, SIGKILL or SIGHUP to a running command's process group."""
        send_signal(self, task_id, name)

    # -- HTTP with retries ----------------------------------------------------------------------

    def _file_call(self, call: _Call) -> tuple[dict[str, Any], bool]:
        """A file call's 200 body; while the first try is still running, ask again with the same key."""
        budget = Budget(self.policy)
        while True:
            response = self._request("POST", "/v1/tool-calls", call=call, budget=budget)
            if response.status_code == 200:
                return response.json(), _replayed(response)
            error = IdempotencyKeyInUse(response.status_code, "idempotency_key_in_use", "the call is still running")
            budget.wait(error, retry_after(response.headers.get("Retry-After")) or 1.0, failure=False)

    def _request(self, method: str, path: str, *, call: _Call | None = None, headers: Mapping[str, str] | None = None,
                 read_s: float = 0.0, budget: Budget | None = None) -> requests.Response:
        """A 2xx answer, or a 409 in use for `call`; every other refusal raised as its error."""
        budget = budget or Budget(self.policy)
        sent = {**self._headers, **(headers or {})}
        if call is not None:
            sent.update({"Idempotency-Key": call.key, "Content-Type": "application/json"})
        while True:
            try:
                response = self.session.request(method, self.url + path, data=call.body if call else None,
                                                headers=sent, timeout=(self.timeout, self.timeout + read_s))
            except _NETWORK_ERRORS as exc:
                budget.wait(ConnectionFailed(0, "connection_failed", f"{method} {path}: {type(exc).__name__}"), None)
                continue
            if response.status_code < 400:
                return response
            error = _problem(response)
            if call is not None and error.code == "idempotency_key_in_use":
                return response
            if not retryable(response.status_code, error.code):
                raise error
            budget.wait(error, retry_after(response.headers.get("Retry-After")))

    def _failure(self, task_id: str) -> CallFailed:
        result = self.get(task_id).result or {}
        return CallFailed(0, str(result.get("code", "failed")), str(result.get("message", "the call failed")),
                          dict(result))


def _base_sha(base_sha: str | None, old_content: bytes | None, what: str) -> str:
    """The `base_sha` a patch is sent with: given, or the blob sha of the bytes it was made against."""
    if (base_sha is None) == (old_content is None):
        raise TypeError(f"{what} needs exactly one of base_sha and old_content")
    return base_sha if base_sha is not None else blob_sha(old_content or b"")


def _shell_parameters(command: str, timeout_ms: int | None, cwd: str | None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"command": command}
    if timeout_ms is not None:
        parameters["timeout_ms"] = timeout_ms
    if cwd is not None:
        parameters["cwd"] = cwd
    return parameters


def _shell_result(body: Mapping[str, Any], replayed: bool) -> ShellResult | None:
    """The result a 200 carries, when it holds every byte of the output (else None: use the stream)."""
    status, result = body["status"], body.get("result") or {}
    if status == "failed":
        raise CallFailed(200, str(result.get("code", "failed")), str(result.get("message", "")), dict(result))
    if "stdout" not in result or result.get("stdout_truncated") or result.get("stderr_truncated"):
        return None
    output = {}
    for name in ("stdout", "stderr"):
        output[name] = wire_bytes(result[name], result.get(f"{name}_encoding", "utf-8"))
        if result.get(f"{name}_sha256") not in (None, _sha256(output[name])):
            raise IntegrityError(0, "integrity_error", f"{name} of {body['task_id']} does not match its sha256")
    return ShellResult.from_result(body["task_id"], body["call_id"], status, result, output["stdout"],
                                   output["stderr"], replayed)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _task(body: Mapping[str, Any]) -> Task:
    return Task(task_id=body["task_id"], call_id=body["call_id"], tool_name=body["tool_name"],
                status=body["status"], result=body.get("result"))


def _replayed(response: requests.Response) -> bool:
    return response.headers.get("Idempotent-Replayed", "").lower() == "true"


def _problem(response: requests.Response) -> RunwardenError:
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if not isinstance(problem, dict):  # not runwarden's answer (a proxy's, say)
        problem = {"code": f"http_{response.status_code}", "detail": response.reason or ""}
    return RunwardenError.from_problem(response.status_code, problem)

