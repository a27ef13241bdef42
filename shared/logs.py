"""Structured logs (contract section 12): with RUNWARDEN_LOG_FORMAT=json, one JSON object a line.

Every line carries `task_id`, `call_id`, `tenant` and `sub` where the process knows them: the API
binds them per request (`bind`, reset at each request's start: gunicorn's threads serve one request
after another), a worker per task (Celery's task_prerun/postrun, around its own "received" and
"succeeded" lines too), so one call can be followed from the API's line to the worker's. The
formatter is python-json-logger's. What runwarden logs never holds a token, a secret, a file's
content or a command's output; Celery's `data` extra (a failed task's arguments) is dropped.
"""
from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from shared.settings import Settings

FIELDS = ("task_id", "call_id", "tenant", "sub")
_CONTEXT: ContextVar[dict[str, str]] = ContextVar("runwarden_log_context", default={})  # replaced, never mutated
# Celery passes its log context as `extra={"data": …}`; for a failed task that is its arguments.
DROPPED = ("data",)


def bind(**fields: str | None) -> None:
    """Add what is now known about the call being served to this thread's (or task's) lines."""
    _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}})


def reset(**fields: str | None) -> None:
    """Start a new request or task: forget the previous one's fields."""
    _CONTEXT.set({k: v for k, v in fields.items() if v is not None})


class ContextFilter(logging.Filter):
    """Puts the bound fields on every record (null where unknown), and drops Celery's `data`."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _CONTEXT.get()
        for name in FIELDS:
            setattr(record, name, context.get(name))
        for name in DROPPED:
            record.__dict__.pop(name, None)
        return True


def formatter() -> logging.Formatter:
    return JsonFormatter("%(levelname)s %(name)s %(process)d %(message)s", timestamp="time",  # ISO 8601, UTC
                         rename_fields={"levelname": "level", "name": "logger"}, json_ensure_ascii=False)


def configure(settings: Settings, level: int | str = logging.INFO, also: tuple[str, ...] = ()) -> bool:
    """JSON lines on stderr for the root logger, and for the loggers `also` names that keep their
    own handlers (gunicorn's); nothing changes in text mode. Returns whether JSON is on."""
    if settings.log_format != "json":
        return False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    for name in also:
        for own in logging.getLogger(name).handlers:
            own.setFormatter(formatter())
            own.addFilter(ContextFilter())
    return True


def task_fields(call: Any, task_id: str | None) -> dict[str, str | None]:
    """What a worker knows of the call it runs, from its message."""
    fields: dict[str, str | None] = {"task_id": task_id}
    if isinstance(call, dict):
        fields.update({name: call.get(name) for name in ("call_id", "tenant", "sub")})
    return fields
