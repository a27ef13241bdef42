"""`GET /v1/tool-calls/{task_id}/stream`: a shell call's output over WebSocket, replayed then live.

Everything that can refuse a client (Origin, token, scope, tenant, task) runs in `before_request`,
before flask-sock upgrades the connection, so a refusal is an HTTP error and never a 101.
The handler follows the call's Redis Stream (`api.follow`): replay and live delivery are one read
loop, so there is no gap and no duplicate. A client that stops reading
blocks only its own handler (the kernel's socket buffer fills, nothing is queued in the API) and is
dropped after SEND_TIMEOUT_S; it can resume with `after_seq`.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from flask import Blueprint, g, request
from flask_sock import ConnectionClosed, Sock
from redis import RedisError
from wsproto.events import TextMessage

from api import metrics
from api.auth import authenticate, refuse_foreign_origin
from api.follow import Follower
from api.runtime import runtime
from shared.errors import NotFound, SchemaInvalid
from shared.records import Records
from shared.schema import SIGNALS, TOOLS, loads

bp = Blueprint("stream", __name__)
sock = Sock()

STREAM_PATH = "/v1/tool-calls/<task_id>/stream"
SEND_TIMEOUT_S = 60
POLICY_VIOLATION = 1008
INTERNAL_ERROR = 1011
REVOKED_CLOSE = 4401  # contract section 10: the token was revoked while the stream was open
# A stream whose token can be revoked (it has a jti) looks at the process's revocations this often:
# the contract closes it within 2 s of the revocation (Watcher polls every 0.5 s).
REVOCATION_CHECK_MS = 1000
log = logging.getLogger("runwarden.stream")


@bp.before_request
def check_handshake() -> None:
    refuse_foreign_origin()
    grant = authenticate(allow_subprotocol=True)
    task_id = (request.view_args or {}).get("task_id", "")
    view = runtime().records.get(task_id) if len(task_id) <= 64 else None
    if view is None or view.tenant != grant.tenant or view.run_id != grant.run_id or not TOOLS[view.tool_name].streams:
        raise NotFound("No such stream.")
    grant.require_scope(TOOLS[view.tool_name].scope)
    if runtime().settings.placement == "node":
        runtime().placement.require_live(grant.tenant, grant.run_id)  # 503 while its node is down
    g.grant, g.after_seq = grant, _after_seq()


def _after_seq() -> int:
    raw = request.args.get("after_seq", "0")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:  # str.isdigit() also takes "²" and "٣"
        raise SchemaInvalid("after_seq must be a non-negative integer.",
                            errors=[{"pointer": "/after_seq", "message": "not a non-negative integer"}])
    return int(raw)


@sock.route(STREAM_PATH, bp=bp)
def stream(ws, task_id: str) -> None:  # type: ignore[no-untyped-def]
    """After the upgrade no HTTP error can be sent: a failure closes the socket with 1011."""
    try:
        with metrics.stream_open():
            _follow(ws, task_id)
    except ConnectionClosed:
        pass
    except Exception as exc:  # Redis went away, or a bug: the client resumes later with after_seq
        log.warning("stream %s ended early: %s", task_id, type(exc).__name__)
        try:
            ws.close(INTERNAL_ERROR, "stream interrupted; reconnect with after_seq")
        except Exception:
            pass
    finally:
        # gunicorn's gthread worker otherwise waits up to 2 s on its event loop for the client to
        # close the upgraded socket, stalling every connection of the process meanwhile.
        try:
            ws.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _follow(ws, task_id: str) -> None:  # type: ignore[no-untyped-def]
    rt, grant = runtime(), g.grant
    ws.sock.settimeout(SEND_TIMEOUT_S)
    threading.Thread(target=_receive_signals, args=(ws, rt.records, task_id), daemon=True).start()
    follower = Follower(rt, task_id, g.after_seq)

    revoked = False

    def budget_ms() -> int:  # a client that went away frees its thread and Redis connection
        nonlocal revoked
        if not ws.connected:
            return 0
        if grant.jti is not None and rt.revocations.revoked(grant.jti, grant.tenant):
            revoked = True
            return 0
        left = int((grant.exp - time.time()) * 1000)
        return min(left, REVOCATION_CHECK_MS) if grant.jti is not None else left

    for event in follower.events(budget_ms):
        if event is not None:
            _send_text(ws, event)
    if revoked:  # the call goes on: another token of the run may still watch or cancel it
        ws.close(REVOKED_CLOSE, "token revoked")
    elif follower.ended == "exit":
        ws.close(1000)
    elif follower.ended is not None:
        ws.close(1000 if follower.ended == "done" else POLICY_VIOLATION, follower.ended)
    elif ws.connected:
        ws.close(POLICY_VIOLATION, "token expired")


def _send_text(ws, text: str) -> None:  # type: ignore[no-untyped-def]
    # simple_websocket's send() uses socket.send, which may write part of a large frame when the
    # socket has a timeout; sendall writes the whole frame or raises.
    if not ws.connected:
        raise ConnectionClosed(ws.close_reason, ws.close_message)
    ws.sock.sendall(ws.ws.send(TextMessage(data=text)))


def _receive_signals(ws, records: Records, task_id: str) -> None:  # type: ignore[no-untyped-def]
    """Client → server: `{"type": "signal", "signal": "SIGINT"}` reaches the call's process group,
    also when it is sent before the command has started."""
    while True:
        try:
            message = ws.receive()
        except (ConnectionClosed, OSError):
            return
        if message is None:
            return
        try:
            order = loads(message)  # as every body: a repeated "signal" key is no order
        except (TypeError, SchemaInvalid):
            continue
        if isinstance(order, dict) and order.get("type") == "signal" and order.get("signal") in SIGNALS:
            try:
                records.send_signal(task_id, order["signal"])
            except RedisError:
                return  # the stream itself ends on the same outage
