"""Operator endpoints of a tenant: `POST /v1/admin/revocations` (contract section 10), `GET /v1/audit`
(section 12). Each acts on the token's own tenant."""
from __future__ import annotations

import time

from flask import Blueprint, Response, request

from api.auth import authenticate
from api.problems import json_response
from api.runtime import runtime
from shared import audit, revocations
from shared.errors import SchemaInvalid, UnsupportedMediaType
from shared.schema import loads

bp = Blueprint("admin", __name__)
MAX_JTI = 256
MAX_SINCE = 64
NDJSON = "application/x-ndjson"


@bp.post("/v1/admin/revocations")
def revoke() -> Response:
    """Revoke one of the admin's own tenant's tokens by its `jti`, until it would have expired
    (no token lives longer than RUNWARDEN_JWT_MAX_LIFETIME). Idempotent: no Idempotency-Key."""
    grant = authenticate()
    grant.require_scope("tenant:admin")
    if request.mimetype not in ("application/json", ""):
        raise UnsupportedMediaType("Send {\"jti\": …} as application/json.")
    body = loads(request.get_data(cache=True))
    jti = body.get("jti") if isinstance(body, dict) else None
    if not isinstance(jti, str) or not 0 < len(jti) <= MAX_JTI or set(body) != {"jti"}:
        raise SchemaInvalid("Send {\"jti\": \"<the token's jti>\"} and nothing else.",
                            errors=[{"pointer": "/jti", "message": f"a string of 1-{MAX_JTI} characters"}])
    rt = runtime()
    ttl_s = rt.settings.jwt_max_lifetime_s
    revocations.revoke(rt.redis, jti, ttl_s, grant.tenant)
    return json_response({"jti": jti, "tenant": grant.tenant, "revoked": True, "expires_in": ttl_s})


@bp.get("/v1/audit")
def audit_trail() -> Response:
    """The tenant's audit trail as JSON lines, oldest first: `since` an ISO 8601 time or a number of
    seconds before now, `limit` records at most (default 1000, up to 10000)."""
    grant = authenticate()
    grant.require_scope("audit:read")
    since_ms, limit = _since(request.args.get("since")), _limit(request.args.get("limit"))
    records = audit.read(runtime().redis, grant.tenant, since_ms, limit)
    return Response(audit.json_lines(records), content_type=NDJSON)


def _since(raw: str | None) -> int:
    try:
        if raw is not None and len(raw) > MAX_SINCE:
            raise ValueError
        return audit.parse_since(raw, int(time.time() * 1000))
    except (ValueError, OverflowError, OSError):
        raise SchemaInvalid("since must be an ISO 8601 time or a number of seconds.",
                            errors=[{"pointer": "/since", "message": "not an ISO 8601 time nor seconds"}]) from None


def _limit(raw: str | None) -> int:
    if raw is None:
        return audit.DEFAULT_LIMIT
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= audit.MAX_LIMIT:
        raise SchemaInvalid(f"limit must be an integer from 1 to {audit.MAX_LIMIT}.",
                            errors=[{"pointer": "/limit", "message": f"an integer from 1 to {audit.MAX_LIMIT}"}])
    return int(raw)
