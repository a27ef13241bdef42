"""Short-lived scoped tokens: decode with the configured algorithm only, and the grant they carry."""
from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jwt

from shared.errors import ForbiddenScope, PathForbidden, TokenExpired, Unauthorized
from shared.paths import NAME_RE, path_allowed
from shared.settings import Settings

REQUIRED_CLAIMS = ("sub", "tenant", "run_id", "scopes", "allowed_paths", "exp", "iat", "aud")
REVOKED = "The token has been revoked."
SCOPES = ("files:read", "files:write", "shell:exec", "shell:network", "workspaces:admin")
MAX_LIST = 256
MAX_STR = 256


@dataclass(frozen=True)
class Grant:
    """What a verified token allows."""

    sub: str
    tenant: str
    run_id: str
    scopes: frozenset[str]
    allowed_paths: tuple[str, ...]
    allowed_commands: tuple[str, ...] | None
    exp: int
    jti: str | None

    def require_scope(self, scope: str) -> None:
        if scope not in self.scopes:
            raise ForbiddenScope(f"This call needs the scope {scope!r}.")

    def require_path(self, path: str) -> None:
        if not path_allowed(self.allowed_paths, path):
            raise PathForbidden("The token's allowed_paths do not cover this path.")


def _string_list(claims: dict[str, Any], name: str) -> tuple[str, ...]:
    value = claims.get(name)
    if (
        not isinstance(value, list)
        or len(value) > MAX_LIST
        or not all(isinstance(item, str) and 0 < len(item) <= MAX_STR for item in value)
    ):
        raise Unauthorized(f"Claim {name!r} must be a list of short strings.")
    return tuple(value)


def verify(token: str, settings: Settings) -> Grant:
    """Check signature, algorithm, audience, times and claim shapes; raise 401 errors otherwise.

    A token is decoded once and its grant kept until the token expires: agents send the same
    token with every call, and decoding it (~0.2 ms) was a tenth of the API's CPU per call. Nothing
    a cached grant was checked for can change, except expiry (checked here on every call) and
    revocation (checked by the caller on every call).
    """
    grant = _verified(token, settings)
    if grant.exp <= time.time():
        raise TokenExpired("The token has expired.")
    return grant


@functools.lru_cache(maxsize=4096)
def _verified(token: str, settings: Settings) -> Grant:
    """Only grants are kept: a refusal raises, and lru_cache keeps nothing for it."""
    try:
        claims = jwt.decode(
            token,
            settings.jwt_verify_key,
            algorithms=list(settings.jwt_algorithms),
            audience=settings.jwt_audience,
            options={"require": list(REQUIRED_CLAIMS), "verify_signature": True},
            leeway=0,
        )
    except jwt.ExpiredSignatureError:
        raise TokenExpired("The token has expired.") from None
    except jwt.InvalidTokenError as exc:
        raise Unauthorized(f"Invalid token: {type(exc).__name__}.") from None
    return _grant(claims, settings)


def _grant(claims: dict[str, Any], settings: Settings) -> Grant:
    for name in ("sub", "tenant", "run_id"):
        if not isinstance(claims.get(name), str) or not claims[name]:
            raise Unauthorized(f"Claim {name!r} must be a non-empty string.")
    for name in ("tenant", "run_id"):
        if not NAME_RE.fullmatch(claims[name]):  # match's $ allows a final \n
            raise Unauthorized(f"Claim {name!r} has characters that are not allowed.")
    for name in ("exp", "iat"):
        if isinstance(claims[name], bool) or not isinstance(claims[name], (int, float)):
            raise Unauthorized(f"Claim {name!r} must be a number.")
    if claims["exp"] - claims["iat"] > settings.jwt_max_lifetime_s:
        raise Unauthorized(f"Token lifetime exceeds {settings.jwt_max_lifetime_s} seconds.")
    commands = _string_list(claims, "allowed_commands") if "allowed_commands" in claims else None
    jti = claims.get("jti")
    if jti is not None and (not isinstance(jti, str) or len(jti) > MAX_STR):
        raise Unauthorized("Claim 'jti' must be a short string.")
    return Grant(
        sub=claims["sub"],
        tenant=claims["tenant"],
        run_id=claims["run_id"],
        scopes=frozenset(_string_list(claims, "scopes")),
        allowed_paths=_string_list(claims, "allowed_paths"),
        allowed_commands=commands,
        exp=int(claims["exp"]),
        jti=jti,
    )


def mint(
    secret: bytes,
    *,
    tenant: str,
    run_id: str,
    sub: str,
    scopes: list[str],
    paths: list[str],
    ttl_s: int = 900,
    audience: str = "runwarden",
    commands: list[str] | None = None,
    algorithm: str = "HS256",
) -> str:
    """A signed token for `runwarden token mint`, the dev stack and tests."""
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": sub,
        "tenant": tenant,
        "run_id": run_id,
        "scopes": scopes,
        "allowed_paths": paths,
        "iat": now,
        "exp": now + ttl_s,
        "aud": audience,
        "jti": uuid.uuid4().hex,
    }
    if commands is not None:
        claims["allowed_commands"] = commands
    return jwt.encode(claims, secret, algorithm=algorithm)
