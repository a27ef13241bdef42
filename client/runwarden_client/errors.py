"""One exception tree: every problem+json `code` of the contract (section 7) has its class, and the
client's own failures (the network, a stream whose bytes do not match its sha256) sit beside them.

`RunwardenError.from_problem` picks the class by `code`; a code this client does not know yet is a
plain `RunwardenError`, so a newer server never breaks an older client.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RunwardenError(Exception):
    """A refused or failed call: the HTTP `status` (0 when no answer came), the problem's `code`
    and `detail`, and the whole problem+json body in `problem`."""

    code = "error"

    def __init__(self, status: int, code: str, detail: str, problem: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.status = status
        self.code = code  # the server's code, also for a class that stands for several
        self.detail = detail
        self.problem: Mapping[str, Any] = problem or {}

    @property
    def task_id(self) -> str | None:
        value = self.problem.get("task_id")
        return value if isinstance(value, str) else None

    @property
    def failed_index(self) -> int | None:
        """For `apply_patches`: the position of the entry that failed (none of them was applied)."""
        value = self.problem.get("failed_index")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @staticmethod
    def from_problem(status: int, problem: Mapping[str, Any]) -> RunwardenError:
        code = str(problem.get("code") or f"http_{status}")
        detail = str(problem.get("detail") or problem.get("title") or "")
        return _BY_CODE.get(code, RunwardenError)(status, code, detail, problem)


class MissingIdempotencyKey(RunwardenError):
    code = "missing_idempotency_key"


class InvalidIdempotencyKey(RunwardenError):
    code = "invalid_idempotency_key"


class SchemaInvalid(RunwardenError):
    """The call does not match the tool's schema; `errors` holds a JSON pointer and message each."""
    code = "schema_invalid"

    @property
    def errors(self) -> list[Mapping[str, Any]]:
        found = self.problem.get("errors")
        return list(found) if isinstance(found, list) else []


class Unauthorized(RunwardenError):
    """No valid token (also a revoked one, and a stream closed with 4401)."""
    code = "unauthorized"


class TokenExpired(Unauthorized):
    code = "token_expired"


class ForbiddenScope(RunwardenError):
    code = "forbidden_scope"


class PathForbidden(RunwardenError):
    code = "path_forbidden"


class CommandForbidden(RunwardenError):
    code = "command_forbidden"


class ForbiddenOrigin(RunwardenError):
    code = "forbidden_origin"


class IdempotencyKeyInUse(RunwardenError):
    """The first request with this key is still running (the client waits and retries it)."""
    code = "idempotency_key_in_use"


class IdempotencyKeyReused(RunwardenError):
    code = "idempotency_key_reused"


class BaseShaMismatch(RunwardenError):
    """The file changed since `base_sha`; `current_sha` is its sha now (read it again)."""
    code = "base_sha_mismatch"

    @property
    def current_sha(self) -> str | None:
        value = self.problem.get("current_sha")
        return value if isinstance(value, str) else None


class PatchDoesNotApply(RunwardenError):
    code = "patch_does_not_apply"


class FileNotFound(RunwardenError):
    code = "file_not_found"


class NotFound(RunwardenError):
    code = "not_found"


class PayloadTooLarge(RunwardenError):
    code = "payload_too_large"


class RateLimited(RunwardenError):
    code = "rate_limited"


class QuotaExceeded(RateLimited):
    """A tenant quota (its name in `quota`) is spent for now; `Retry-After` says when to come back."""
    code = "quota_exceeded"

    @property
    def quota(self) -> str | None:
        value = self.problem.get("quota")
        return value if isinstance(value, str) else None


class ArchiveRejected(RunwardenError):
    code = "archive_rejected"


class WorkspaceBusy(RunwardenError):
    code = "workspace_busy"


class WorkspaceExists(RunwardenError):
    code = "workspace_exists"


class Unavailable(RunwardenError):
    code = "unavailable"


class SandboxUnavailable(Unavailable):
    code = "sandbox_unavailable"


class WorkspaceUnavailable(Unavailable):
    code = "workspace_unavailable"


class CallFailed(RunwardenError):
    """runwarden could not run the call (status `failed`): `code` and `detail` are the result's."""
    code = "call_failed"


class ConnectionFailed(RunwardenError):
    """No answer from the server after every allowed retry (status 0)."""
    code = "connection_failed"


class StreamError(RunwardenError):
    """The stream ended without its exit event (expired, or closed by the server with an error)."""
    code = "stream_error"


class IntegrityError(RunwardenError):
    """The bytes received do not match the sha256 (or git blob sha) the server reported."""
    code = "integrity_error"


def _subclasses(cls: type[RunwardenError]) -> list[type[RunwardenError]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


_BY_CODE: dict[str, type[RunwardenError]] = {cls.code: cls for cls in _subclasses(RunwardenError)}
