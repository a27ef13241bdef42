"""`POST /mcp`: the Model Context Protocol's Streamable HTTP transport (contract section 9).

The HTTP side only: the Origin (DNS rebinding), the token, the media type, then the message goes to
`api.mcp`. Stateless, so there is no session to open a GET stream on or to DELETE: both are 405
(Flask's own answer for a route that takes POST only), and no `Mcp-Session-Id` is ever set.
"""
from __future__ import annotations

from flask import Blueprint, Response, request

from api import mcp
from api.auth import authenticate, refuse_foreign_origin
from api.runtime import runtime
from shared.errors import UnsupportedMediaType

bp = Blueprint("mcp", __name__)


@bp.post("/mcp")
def endpoint() -> Response:
    refuse_foreign_origin()
    grant = authenticate()
    if request.mimetype not in ("application/json", ""):
        raise UnsupportedMediaType("POST JSON-RPC messages as application/json.")
    exchange = mcp.Exchange(runtime(), grant, request.headers.get("MCP-Protocol-Version"),
                            request.headers.getlist("Idempotency-Key"),
                            request.accept_mimetypes["text/event-stream"] > 0)
    return mcp.answer(exchange, request.get_data(cache=False))
