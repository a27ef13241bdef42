"""Bearer tokens: where they are taken from, and the checks that need Redis (revocation)."""
from __future__ import annotations

from flask import request

from api.runtime import runtime
from shared import logs, revocations, tokens
from shared.errors import ForbiddenOrigin, Unauthorized
from shared.tokens import Grant

MAX_TOKEN = 8192
SUBPROTOCOL = "runwarden.v1"
BEARER_SUBPROTOCOL = "bearer."


def _header_token() -> str | None:
    values = request.headers.getlist("Authorization")
    if not values:
        return None
    if len(values) > 1:
        raise Unauthorized("Send one Authorization header.")
    scheme, _, token = values[0].strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Use 'Authorization: Bearer <token>'.")
    return token.strip()


def _subprotocol_token() -> str | None:
    """Browsers cannot set headers on a WebSocket: they offer `bearer.<token>` as a subprotocol."""
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    for protocol in (p.strip() for p in offered.split(",")):
        if protocol.startswith(BEARER_SUBPROTOCOL):
            return protocol[len(BEARER_SUBPROTOCOL):]
    return None


def authenticate(*, allow_subprotocol: bool = False, check_revoked: bool = True) -> Grant:
    """The token's grant. `check_revoked=False` leaves the revocation check to the caller (a POST
    makes it inside the idempotency claim, saving a round trip; see `refuse_if_revoked`)."""
    token = _header_token()
    if token is None and allow_subprotocol:
        token = _subprotocol_token()
    if not token:
        raise Unauthorized("A bearer token is required.")
    if len(token) > MAX_TOKEN:
        raise Unauthorized("The token is too long.")
    rt = runtime()
    grant = tokens.verify(token, rt.settings)
    logs.bind(tenant=grant.tenant, sub=grant.sub)
    if check_revoked:
        refuse_if_revoked(grant)
    return grant


def refuse_if_revoked(grant: Grant) -> None:
    if grant.jti is not None and revocations.is_revoked(runtime().redis, grant.jti, grant.tenant):
        raise Unauthorized(tokens.REVOKED)


def refuse_foreign_origin() -> None:
    """A browser's request from a page outside RUNWARDEN_ALLOWED_ORIGINS is refused (403): cross-site
    WebSocket hijacking, and DNS rebinding against /mcp. Clients that are not browsers send no Origin."""
    origin = request.headers.get("Origin")
    if origin is not None and origin not in runtime().settings.allowed_origins:
        raise ForbiddenOrigin("This Origin may not call runwarden (RUNWARDEN_ALLOWED_ORIGINS).")
