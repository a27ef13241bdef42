"""runwarden's Python client: typed tool calls with safe retries, and byte-exact output streams.

    from runwarden_client import Client
    client = Client("http://127.0.0.1:8080", token)
    result = client.run("pytest -q")        # ShellResult: exit_code, stdout (bytes), stderr (bytes)

It needs only `requests` and `websocket-client`; it never imports the server's packages.
"""
from __future__ import annotations

from runwarden_client.client import Client
from runwarden_client.errors import (RunwardenError, MissingIdempotencyKey, InvalidIdempotencyKey, SchemaInvalid,
                                      Unauthorized, TokenExpired, ForbiddenScope, PathForbidden, CommandForbidden,
                                      ForbiddenOrigin, IdempotencyKeyInUse, IdempotencyKeyReused, BaseShaMismatch,
                                      PatchDoesNotApply, FileNotFound, NotFound, PayloadTooLarge, RateLimited,
                                      QuotaExceeded, ArchiveRejected, WorkspaceBusy, WorkspaceExists,
                                      Unavailable, SandboxUnavailable, WorkspaceUnavailable, CallFailed,
                                      ConnectionFailed, StreamError, IntegrityError)
from runwarden_client.results import (ZERO_SHA, Event, Exit, FileChange, FileResult, Output, PatchResult,
                                      PatchSetResult, ShellResult, Task, blob_sha)
from runwarden_client.stream import Stream
from runwarden_client.version import __version__

__all__ = [
    "Client", "Stream", "Event", "Output", "Exit", "FileResult", "PatchResult", "FileChange", "PatchSetResult",
    "ShellResult", "Task",
    "ZERO_SHA", "blob_sha", "__version__",
    "RunwardenError", "MissingIdempotencyKey", "InvalidIdempotencyKey", "SchemaInvalid", "Unauthorized",
    "TokenExpired", "ForbiddenScope", "PathForbidden", "CommandForbidden", "ForbiddenOrigin",
    "IdempotencyKeyInUse", "IdempotencyKeyReused", "BaseShaMismatch", "PatchDoesNotApply", "FileNotFound",
    "NotFound", "PayloadTooLarge", "RateLimited", "QuotaExceeded", "ArchiveRejected", "WorkspaceBusy",
    "WorkspaceExists", "Unavailable", "SandboxUnavailable", "WorkspaceUnavailable", "CallFailed",
    "ConnectionFailed", "StreamError", "IntegrityError",
]
