"""Tool definitions, health, readiness and metrics: no token needed."""
from __future__ import annotations

import time

from flask import Blueprint, Response, request

from api import openapi
from api.metrics import exposition
from api.problems import json_response
from api.runtime import runtime
from shared.errors import SchemaInvalid, Unavailable
from shared.schema import openai_tools, tool_definitions

bp = Blueprint("meta", __name__)
_WORKER_CHECK = {"at": 0.0, "ok": False}
WORKER_CHECK_TTL_S = 2.0


@bp.get("/v1/tools")
def tools() -> Response:
    fmt = request.args.get("format", "")
    if fmt == "openai":
        return json_response({"tools": openai_tools()})
    if fmt not in ("", "runwarden"):
        raise SchemaInvalid("format must be 'openai' or omitted.",
                            errors=[{"pointer": "/format", "message": "unknown format"}])
    return json_response({"tools": tool_definitions()})


@bp.get("/healthz")
def healthz() -> Response:
    return json_response({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Response:
    rt = runtime()
    rt.redis.ping()
    if not _worker_answers():
        raise Unavailable("No worker answered; calls would wait in the queue.")
    return json_response({"status": "ready"})


def _worker_answers() -> bool:
    """A worker answered a broadcast ping within a second (cached briefly). Control messages are
    handled by each worker's main process, so a fleet busy with long calls still answers."""
    now = time.monotonic()
    if now - _WORKER_CHECK["at"] < WORKER_CHECK_TTL_S and _WORKER_CHECK["ok"]:
        return True
    try:
        ok = bool(runtime().celery.control.ping(timeout=1.0))
    except Exception:  # broker error: not ready
        ok = False
    _WORKER_CHECK.update(at=now, ok=ok)
    return ok


@bp.get("/openapi.json")
def openapi_document() -> Response:
    return json_response(openapi.document())


@bp.get("/metrics")
def metrics() -> Response:
    return exposition(runtime().settings)
