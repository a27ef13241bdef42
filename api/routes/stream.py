"""`GET /v1/tool-calls/{task_id}/stream`: a shell call's output over WebSocket, replayed then live.

Everything that can refuse a client (Origin, token, scope, tenant, task, capacity) runs on a gunicorn
thread before the upgrade, so a refusal is an HTTP error and never a 101. The accepted handshake's
socket is then handed to the process's stream server (`api/streams.py`), which writes the 101 and
the events on its event loop: an open stream holds no thread, and plain HTTP keeps all of them.
"""
from __future__ import annotations

from collections.abc import Sequence

from flask import Blueprint, Response, g, request
from websockets.datastructures import Headers
from websockets.http11 import Request
from websockets.http11 import Response as WsResponse
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from api import server
from api.auth import SUBPROTOCOL, authenticate, refuse_foreign_origin
from api.runtime import runtime
from api.streams import Opening
from shared.errors import BadRequest, NotFound, SchemaInvalid, Unavailable
from shared.schema import TOOLS

bp = Blueprint("stream", __name__)

STREAM_PATH = "/v1/tool-calls/<task_id>/stream"
MAX_CLIENT_MESSAGE = 4096  # a signal is a few dozen bytes
HANDSHAKE_HEADERS = {"host", "connection", "upgrade", "sec-websocket-key", "sec-websocket-version"}


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


@bp.route(STREAM_PATH, websocket=True)  # werkzeug matches only WebSocket handshakes here
def stream(task_id: str) -> Response:
    rt = runtime()
    protocol, answer = _accept()
    if not rt.streams.admit():
        raise StreamsFull("This API process holds all the open streams it may; retry shortly.")
    try:
        rt.streams.start()
        protocol.send_response(answer)
        sock, buffered = server.detach(request.environ)
    except BaseException:
        rt.streams.release()
        raise
    grant = g.grant
    rt.streams.hand_over(sock, buffered, protocol, Opening(task_id, g.after_seq, grant.jti, grant.tenant, grant.exp))
    return server.HandedOver()


def _accept() -> tuple[ServerProtocol, WsResponse]:
    """websockets' own handshake checks (Upgrade, key, version, subprotocol), fed the request as it
    came, less what the checks above already used: the token never reaches its parser or logs."""
    headers = Headers()
    for name, value in request.headers.items():
        if name.lower() in HANDSHAKE_HEADERS:
            headers[name] = value
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    if SUBPROTOCOL in offered:  # without the `bearer.<token>` offered beside it
        headers["Sec-WebSocket-Protocol"] = SUBPROTOCOL
    protocol = ServerProtocol(subprotocols=[Subprotocol(SUBPROTOCOL)], select_subprotocol=_subprotocol,
                              max_size=MAX_CLIENT_MESSAGE)
    protocol.receive_data(Request(request.path, headers).serialize())
    parsed = [event for event in protocol.events_received() if isinstance(event, Request)]
    answer = protocol.accept(parsed[0]) if parsed else None
    if answer is None or answer.status_code != 101:
        raise BadRequest("This is a WebSocket endpoint: send a WebSocket (version 13) handshake.")
    return protocol, answer


class StreamsFull(Unavailable):
    """RUNWARDEN_MAX_STREAMS streams are open in this process, or it is draining (SIGTERM)."""


def _subprotocol(_: ServerProtocol, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    """`runwarden.v1` when the client offers it (a browser, with `bearer.<token>`); else none."""
    return Subprotocol(SUBPROTOCOL) if SUBPROTOCOL in offered else None
