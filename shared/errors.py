"""Every failure the contract names, one class each, carrying its `code` and HTTP status.

The API turns any `RunwardenError` into `application/problem+json` in one place
(`api/problems.py`); workers return the same shape for a tool's own failures.
"""
from __future__ import annotations

from typing import Any


class RunwardenError(Exception):
    """Base: a failure with a stable machine-readable code and an HTTP status."""

    code = "error"
    status = 500
    title = "Error"

    def __init__(self, detail: str = "", **extra: Any) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.extra = extra
        self.headers: dict[str, str] = {}

    def problem(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"https://runwarden.dev/problems/{self.code}",
            "title": self.title,
            "status": self.status,
            "code": self.code,
            "detail": self.detail,
        }
        body.update(self.extra)
        return body


class MissingIdempotencyKey(RunwardenError):
    """The POST carried no Idempotency-Key header."""
    code, status, title = "missing_idempotency_key", 400, "Idempotency-Key header is required"


class InvalidIdempotencyKey(RunwardenError):
    """The key is empty, too long, has forbidden characters, or the header was sent twice."""
    code, status, title = "invalid_idempotency_key", 400, "Idempotency-Key is not valid"


class SchemaInvalid(RunwardenError):
    """The body is not JSON or does not match the tool-call schema; `errors` lists JSON pointers."""
    code, status, title = "schema_invalid", 400, "Request does not match the schema"


class Unauthorized(RunwardenError):
    """No token, a malformed token, a bad signature, or a claim that does not hold."""
    code, status, title = "unauthorized", 401, "Authentication required"

    def __init__(self, detail: str = "", **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.headers["WWW-Authenticate"] = 'Bearer realm="runwarden"'


class TokenExpired(Unauthorized):
    """The token's `exp` has passed."""
    code, title = "token_expired", "Token expired"


class ForbiddenScope(RunwardenError):
    """The token lacks the scope the tool needs."""
    code, status, title = "forbidden_scope", 403, "Token lacks the required scope"


class PathForbidden(RunwardenError):
    """The path is malformed, leaves the workspace, or is outside `allowed_paths`."""
    code, status, title = "path_forbidden", 403, "Path is not allowed"


class CommandForbidden(RunwardenError):
    """A program the command would run is not in `allowed_commands`, or it cannot be parsed."""
    code, status, title = "command_forbidden", 403, "Command is not allowed"


class ForbiddenOrigin(RunwardenError):
    """A WebSocket handshake or an MCP request from an Origin outside RUNWARDEN_ALLOWED_ORIGINS
    (cross-site hijacking, DNS rebinding)."""
    code, status, title = "forbidden_origin", 403, "Origin not allowed"


class IdempotencyKeyInUse(RunwardenError):
    """The same request with this key is still running."""
    code, status, title = "idempotency_key_in_use", 409, "A request with this Idempotency-Key is in progress"


class IdempotencyKeyReused(RunwardenError):
    """The key was used before for a different request."""
    code, status, title = "idempotency_key_reused", 422, "Idempotency-Key was used for a different request"


class BaseShaMismatch(RunwardenError):
    """The file's current blob SHA is not the patch's `base_sha`; `current_sha` says what it is."""
    code, status, title = "base_sha_mismatch", 412, "File changed since base_sha"


class PatchDoesNotApply(RunwardenError):
    """The diff is malformed, names several files, or its context does not match exactly."""
    code, status, title = "patch_does_not_apply", 422, "Patch does not apply"


class FileNotFound(RunwardenError):
    """The file to read or patch does not exist in the workspace."""
    code, status, title = "file_not_found", 404, "File not found"


class NotFound(RunwardenError):
    """No such task, route, or a task of another tenant (never 403, so ids cannot be probed)."""
    code, status, title = "not_found", 404, "Not found"


class MethodNotAllowed(RunwardenError):
    """The route exists but not for this method."""
    code, status, title = "method_not_allowed", 405, "Method not allowed"


class ArchiveRejected(RunwardenError):
    """An uploaded archive (or a clone) that may not become a workspace: a member leading out of it,
    a special file, or more bytes or files than the quota allows. `member` names the offending
    member (null when the archive as a whole is at fault). Nothing of it is written."""
    code, status, title = "archive_rejected", 422, "Archive rejected"

    def __init__(self, detail: str, member: str | None) -> None:
        super().__init__(detail, member=member)


class CloneFailed(RunwardenError):
    """git could not clone the repository (not found, no such ref, unreachable, too slow); the
    detail carries the end of git's own message."""
    code, status, title = "clone_failed", 422, "Repository could not be cloned"


class WorkspaceBusy(RunwardenError):
    """A call of the run is queued or running, or another operation on its workspace is under way."""
    code, status, title = "workspace_busy", 409, "Workspace busy"


class WorkspaceExists(RunwardenError):
    """The run already has a workspace; `?replace=true` replaces it."""
    code, status, title = "workspace_exists", 409, "Workspace exists"


class PayloadTooLarge(RunwardenError):
    """The body exceeds the configured limit; refused before it is parsed."""
    code, status, title = "payload_too_large", 413, "Payload too large"


class UnsupportedMediaType(RunwardenError):
    """The body is not sent as application/json."""
    code, status, title = "unsupported_media_type", 415, "Content-Type must be application/json"


class RateLimited(RunwardenError):
    """Too many requests for this tenant."""
    code, status, title = "rate_limited", 429, "Too many requests"


class QuotaExceeded(RunwardenError):
    """A tenant quota is spent for now: `quota` names it, `Retry-After` says when to come back."""
    code, status, title = "quota_exceeded", 429, "Tenant quota exceeded"

    def __init__(self, quota: str, retry_after_s: int) -> None:
        super().__init__(f"The tenant's {quota} quota is spent; retry after {retry_after_s} s.", quota=quota)
        self.headers["Retry-After"] = str(retry_after_s)


class Unavailable(RunwardenError):
    """Redis, the broker, or the sandbox cannot serve right now; retrying later may succeed."""
    code, status, title = "unavailable", 503, "Service unavailable"

    def __init__(self, detail: str = "", **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.headers["Retry-After"] = "1"


class WorkspaceUnavailable(Unavailable):
    """Node placement: the node holding the run's workspace is down (or no node is live)."""
    code, title = "workspace_unavailable", "Workspace unavailable"


class InternalError(RunwardenError):
    """A bug: logged with its trace on the server, never shown to the client."""
    code, status, title = "internal_error", 500, "Internal error"


class SandboxUnavailable(Unavailable):
    """This worker's sandbox failed its self-test; it refuses shell calls rather than run them unconfined."""
    code, title = "sandbox_unavailable", "Sandbox unavailable"


# The HTTP server's own refusals of requests it could not read (api/server.py): problem+json too.

class BadRequest(RunwardenError):
    """The request line or a header is malformed, or the body's framing (chunks) is."""
    code, status, title = "bad_request", 400, "Malformed request"


class RequestTimeout(RunwardenError):
    """The request's headers and body did not all arrive within RUNWARDEN_REQUEST_TIMEOUT."""
    code, status, title = "request_timeout", 408, "Request not received in time"


class UriTooLong(RunwardenError):
    """The request line (method, target, version) exceeds the server's limit."""
    code, status, title = "uri_too_long", 414, "Request line too long"


class ExpectationFailed(RunwardenError):
    """An `Expect` header other than `100-continue`."""
    code, status, title = "expectation_failed", 417, "Expectation not supported"


class RequestHeaderTooLarge(RunwardenError):
    """A header field, or the number of fields, exceeds the server's limits."""
    code, status, title = "request_header_too_large", 431, "Request header fields too large"


class TransferCodingNotImplemented(RunwardenError):
    """A `Transfer-Encoding` other than `chunked`."""
    code, status, title = "unsupported_transfer_coding", 501, "Transfer coding not supported"
