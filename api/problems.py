"""The one place failures become `application/problem+json` responses (RFC 9457)."""
from __future__ import annotations

import json
import logging
from typing import Any

import redis
from flask import Flask, Response, g, request
from kombu.exceptions import OperationalError
from werkzeug.exceptions import HTTPException

from shared import errors

log = logging.getLogger("runwarden.api")

PROBLEM_JSON = "application/problem+json"
_HTTP_ERRORS: dict[int, type[errors.RunwardenError]] = {
    400: errors.SchemaInvalid,
    404: errors.NotFound,
    405: errors.MethodNotAllowed,
    408: errors.RequestTimeout,  # the body stalled (api/server.py)
    413: errors.PayloadTooLarge,
    415: errors.UnsupportedMediaType,
}


def json_response(body: dict[str, Any] | str | bytes, status: int = 200, content_type: str = "application/json",
                  headers: dict[str, str] | None = None) -> Response:
    if isinstance(body, dict):
        body = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return Response(body, status=status, content_type=content_type, headers=headers)


def problem_response(error: errors.RunwardenError) -> Response:
    body = error.problem()
    body.update({k: v for k, v in getattr(g, "call_context", {}).items() if k not in body})
    return json_response(body, error.status, PROBLEM_JSON, error.headers)


MAX_DISCARD = 16 * 1024 * 1024


def _discard_body() -> None:
    """Read and drop an oversized body (never parse or keep it), so the kept-alive connection is not
    left with unread bytes that the next request would be parsed from. gunicorn ignores an
    application's `Connection: close`, so this is the way to keep the connection usable."""
    stream, left = request.environ.get("wsgi.input"), min(request.content_length or MAX_DISCARD, MAX_DISCARD)
    try:
        while stream is not None and left > 0 and (chunk := stream.read(min(left, 65536))):
            left -= len(chunk)
    except (OSError, HTTPException):  # the client went away, or stalled (api/server.py)
        pass


def register(app: Flask) -> None:
    @app.errorhandler(errors.RunwardenError)
    def runwarden_error(error: errors.RunwardenError) -> Response:
        return problem_response(error)

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> Response:
        kind = _HTTP_ERRORS.get(error.code or 500, errors.SchemaInvalid if (error.code or 500) < 500 else errors.Unavailable)
        problem = kind(error.description or "" if kind is errors.SchemaInvalid else "")
        problem.status = error.code or problem.status
        if kind is errors.PayloadTooLarge:
            _discard_body()
        if kind is errors.MethodNotAllowed:
            problem.headers["Allow"] = ", ".join(getattr(error, "valid_methods", None) or [])
        return problem_response(problem)

    @app.errorhandler(redis.RedisError)
    @app.errorhandler(OperationalError)
    def backend_down(error: Exception) -> Response:
        log.warning("backend unavailable on %s %s: %s", request.method, request.path, type(error).__name__)
        return problem_response(errors.Unavailable("Redis or the broker cannot be reached; retry shortly."))

    @app.errorhandler(Exception)
    def unexpected(error: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.path)
        problem = errors.InternalError("An unexpected error occurred; it has been logged.")
        return problem_response(problem)
