"""Workspaces as a resource (contract section 11): `PUT`, `GET` and `DELETE /v1/workspaces…`.

Operator endpoints: the token needs `workspaces:admin` and acts on any run of its own tenant (its
own run_id does not restrict which). The API never touches the workspaces' disk: a worker does the
work (api/workspaces.py), and the list is Redis's record of them (shared/workspaces.py).
"""
from __future__ import annotations

from typing import IO

from flask import Blueprint, Response, request

from api import server, workspaces
from api.auth import authenticate
from api.problems import json_response
from api.runtime import runtime
from shared import keys, tenants
from shared.errors import ArchiveRejected, NotFound, SchemaInvalid, UnsupportedMediaType, WorkspaceBusy, WorkspaceExists
from shared.paths import NAME_RE
from shared.schema import loads
from shared.tokens import Grant
from shared.workspaces import CREATE_TASK, DELETE_TASK, SCOPE, Registry, parse_git_source, upload_body_limit

bp = Blueprint("workspaces", __name__)
ARCHIVE_TYPES = frozenset({"application/x-tar", "application/tar", "application/gzip", "application/x-gzip"})
MAX_JSON_BODY = 64 * 1024
DELETE_WAIT_S = 60


def _grant() -> Grant:
    grant = authenticate()
    grant.require_scope(SCOPE)
    return grant


def _run_id(run_id: str) -> str:
    if not NAME_RE.fullmatch(run_id):  # match's $ would let a final "\n" through
        raise SchemaInvalid("run_id must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$.",
                            errors=[{"pointer": "/run_id", "message": "not a run id"}])
    return run_id


def _replace() -> bool:
    values = request.args.getlist("replace")
    if values in ([], ["false"]):
        return False
    if values == ["true"]:
        return True
    raise SchemaInvalid("replace must be true or false.", errors=[{"pointer": "/replace", "message": "not a boolean"}])


def _has_body() -> bool:
    if request.content_length is not None:
        return request.content_length > 0
    return "chunked" in request.headers.get("Transfer-Encoding", "").lower()


@bp.get("/v1/workspaces")
def listing() -> Response:
    grant, rt = _grant(), runtime()
    listed = Registry(rt.redis).listing(grant.tenant)
    if rt.settings.placement == "node":
        for entry in listed:
            entry["node"] = rt.placement.node_of(grant.tenant, entry["run_id"])
    return json_response({"workspaces": listed})


@bp.put("/v1/workspaces/<run_id>")
def create(run_id: str) -> Response:
    """An empty body: an empty workspace; a tar or gzipped tar: extracted; JSON: a git clone."""
    grant = _grant()
    run_id, replace, rt = _run_id(run_id), _replace(), runtime()
    quota_bytes = tenants.effective(rt.redis, rt.settings, grant.tenant).workspace_bytes
    message: dict[str, object] = {"tenant": grant.tenant, "run_id": run_id, "replace": replace, "source": "empty",
                                  "workspace_bytes": quota_bytes}
    body = None
    if _has_body():
        if request.mimetype in ARCHIVE_TYPES:
            body = _upload(quota_bytes)
            message["source"] = "archive"
        elif request.mimetype == "application/json":
            request.max_content_length = MAX_JSON_BODY
            git = parse_git_source(loads(request.get_data()))
            message.update(source="git", git={"url": git.url, "ref": git.ref})
        else:
            raise UnsupportedMediaType("Send application/x-tar, application/gzip, a JSON git source, or no body.")
    _refuse_early(grant.tenant, run_id, replace)
    node = rt.placement.place(grant.tenant, run_id) if rt.settings.placement == "node" else None
    return workspaces.perform(rt, CREATE_TASK, message, rt.settings.upload_timeout_s, body, node)


def _upload(quota_bytes: int) -> IO[bytes]:
    """The request's body, to be read as it arrives: bounded by what the workspace quota can need
    (not by the tool calls' MAX_CONTENT_LENGTH), and given RUNWARDEN_UPLOAD_TIMEOUT to arrive."""
    rt = runtime()
    limit = upload_body_limit(quota_bytes, rt.settings.workspace_max_files)
    if limit is not None and (request.content_length or 0) > limit:
        raise ArchiveRejected("The archive is larger than the workspace quota allows.", member=None)
    request.max_content_length = limit
    server.allow_request_time(rt.settings.upload_timeout_s)
    return request.stream


def _refuse_early(tenant: str, run_id: str, replace: bool) -> None:
    """What Redis can tell before the body is read (the worker checks again, on disk)."""
    rt = runtime()
    if not replace and Registry(rt.redis).exists(tenant, run_id):
        raise WorkspaceExists("The run has a workspace; add ?replace=true to replace it.")
    if replace and rt.redis.scard(keys.run_active(tenant, run_id)):
        raise WorkspaceBusy("A call of this run is queued or running.")


@bp.delete("/v1/workspaces/<run_id>")
def delete(run_id: str) -> Response:
    grant = _grant()
    run_id, rt = _run_id(run_id), runtime()
    if rt.redis.scard(keys.run_active(grant.tenant, run_id)):
        raise WorkspaceBusy("A call of this run is queued or running.")
    node = None
    if rt.settings.placement == "node":
        node = rt.placement.node_of(grant.tenant, run_id)
        if node is None:
            raise NotFound("No such workspace.")
        rt.placement.require_live(grant.tenant, run_id)
    answer = workspaces.perform(rt, DELETE_TASK, {"tenant": grant.tenant, "run_id": run_id}, DELETE_WAIT_S, node=node)
    if node is not None and answer.status_code in (204, 404):
        rt.placement.free(grant.tenant, run_id)  # deleting the workspace frees the run to be placed again
    return answer
