"""Operator endpoints of a tenant (contract section 10): `POST /v1/admin/revocations`."""
from __future__ import annotations

from flask import Blueprint, Response, request

from api.auth import authenticate
from api.problems import json_response
from api.runtime import runtime
from shared import revocations
from shared.errors import SchemaInvalid, UnsupportedMediaType
from shared.schema import loads

bp = Blueprint("admin", __name__)
MAX_JTI = 256


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
