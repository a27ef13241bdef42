"""How the API has a worker do a workspace operation: send its task, stream an upload's body to it
through Redis, wait for its answer (shared/workspaces.py describes the exchange).

The body is read in CHUNK_BYTES pieces and pushed as it arrives, with at most WINDOW_CHUNKS unread
in Redis, so neither the API nor Redis ever holds an archive: a client faster than the worker's
disk waits (TCP backpressure) while the API waits for room.
"""
from __future__ import annotations

import time
import uuid
from contextlib import suppress
from typing import IO, Any

from flask import Response
from kombu.exceptions import OperationalError
from redis import RedisError
from werkzeug.exceptions import RequestEntityTooLarge

from api.problems import PROBLEM_JSON, json_response
from api.runtime import Runtime
from shared.errors import ArchiveRejected, Unavailable
from shared.workspaces import CHUNK_BYTES, DATA, END, WINDOW_CHUNKS, Operation, queue_for

ANSWER_GRACE_S = 5.0  # past its deadline a worker creates nothing; its answer may still be on its way


def perform(rt: Runtime, task: str, message: dict[str, Any], wait_s: float,
            body: IO[bytes] | None = None, node: str | None = None) -> Response:
    """Run `message` as the worker task `task` (on the run's `node`, under node placement) and
    answer what the worker answers; `body` is an upload to stream to it."""
    op_id = uuid.uuid4().hex
    message = {**message, "op_id": op_id, "deadline": time.time() + wait_s}
    deadline = time.monotonic() + wait_s
    operation = Operation(rt.redis, op_id)
    _send(rt, task, message, wait_s, queue_for(node))
    if body is not None:
        _stream(operation, body, deadline)
    answer = operation.wait_answer(deadline + ANSWER_GRACE_S)
    if answer is None:
        raise Unavailable("No worker finished the operation in time; nothing was changed by it.")
    status, problem = answer
    if status == 204:
        empty = Response(status=204)
        del empty.headers["Content-Type"]  # no content, so no type of it
        return empty
    headers = {"Retry-After": "1"} if status == 503 else None
    return json_response(problem or {}, status, PROBLEM_JSON if status >= 400 else "application/json", headers)


def _send(rt: Runtime, task: str, message: dict[str, Any], wait_s: float, queue: str) -> None:
    summary = {k: message[k] for k in ("tenant", "run_id", "source") if k in message}
    try:
        # `expires`: a message still queued when the API has stopped waiting is dropped unrun.
        rt.celery.send_task(task, args=[message], task_id=message["op_id"], queue=queue, ignore_result=True,
                            expires=wait_s, argsrepr=repr([summary]), kwargsrepr="{}")
    except (OperationalError, RedisError, OSError):
        raise Unavailable("The broker cannot be reached; nothing was done, retry shortly.") from None


def _stream(operation: Operation, body: IO[bytes], deadline: float) -> None:
    """Push the body as it arrives, then its end; stop early once the worker has answered (it
    refused the archive, or the workspace exists). A body that cannot be read whole is aborted."""
    try:
        while piece := _read_piece(body):
            if not _push(operation, piece, deadline):
                return
        _push(operation, END, deadline)
    except RequestEntityTooLarge:
        _abort(operation)
        raise ArchiveRejected("The archive is larger than the workspace quota allows.", member=None) from None
    except BaseException:  # the client stalled (408) or went away, Redis failed: nothing is created
        _abort(operation)
        raise


def _read_piece(body: IO[bytes]) -> bytes:
    """The next CHUNK_BYTES of the body (fewer at its end, b"" after it), tagged as data."""
    parts, size = [DATA], 0
    while size < CHUNK_BYTES and (data := body.read(CHUNK_BYTES - size)):
        parts.append(data)
        size += len(data)
    return b"".join(parts) if size else b""


def _push(operation: Operation, item: bytes, deadline: float) -> bool:
    """False once the worker has answered."""
    unread = operation.push(item)
    if unread < 0:
        return False
    if unread > WINDOW_CHUNKS:
        try:
            return operation.wait_for_room(deadline)
        except TimeoutError:
            raise Unavailable("No worker took the upload in time; nothing was created.") from None
    return True


def _abort(operation: Operation) -> None:
    with suppress(RedisError):
        operation.abort()
