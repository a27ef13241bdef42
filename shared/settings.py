"""The one settings object, read from the environment once at start.

Both the API and the workers call `Settings.from_env()` in their factory and pass the
object down; nothing else reads `os.environ`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from shared.paths import NAME_RE
from urllib.parse import urlsplit

from shared.connections import parse_sentinels

log = logging.getLogger("runwarden.settings")

MIN_HS256_SECRET_BYTES = 32
ASYMMETRIC_ALGORITHMS = ("RS256", "ES256", "EdDSA")


class SettingsError(Exception):
    """The environment describes a configuration runwarden refuses to start with."""


def _int(env: dict[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name} must be at least {minimum}, got {value}")
    return value


def _list(env: dict[str, str], name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in env.get(name, "").split(",") if part.strip())


@dataclass(frozen=True)
class Settings:
    redis_url: str
    jwt_secret: bytes | None = field(repr=False)
    jwt_public_key: bytes | None = field(repr=False)
    jwt_algorithms: tuple[str, ...]
    jwt_audience: str
    jwt_max_lifetime_s: int
    workspaces: Path
    sandbox: str  # "bwrap" or "none"
    allowed_origins: tuple[str, ...]
    max_body_bytes: int
    output_cap_bytes: int
    http_output_bytes: int
    stream_retention_s: int
    idempotency_ttl_s: int
    wait_file_result_s: int
    kill_grace_s: float
    sandbox_memory_bytes: int
    sandbox_max_processes: int
    sandbox_max_file_bytes: int
    sandbox_max_open_files: int
    sandbox_uid: int
    visibility_timeout_s: int
    lease_s: int
    rate_limit_per_s: int
    tenant_max_running: int
    tenant_calls_per_minute: int
    tenant_output_bytes_per_hour: int
    tenant_workspace_bytes: int
    placement: str  # "shared": one workspaces root for all; "node": a run lives on one node's disk
    node: str | None  # a worker's node name (RUNWARDEN_NODE), in node placement
    node_timeout_s: int  # a node without a heartbeat for this long is down
    public_url: str  # base of every stream_url, no trailing "/"; "" means the request's own host
    trusted_proxies: int  # proxy hops whose X-Forwarded-* are believed
    request_timeout_s: int  # to receive one request's headers and body
    max_streams: int  # open WebSocket streams one API process holds; beyond, a handshake is a 503
    stream_send_timeout_s: int  # a stream whose client reads nothing for this long is dropped
    drain_s: int  # after SIGTERM, how long open streams may run on before they are closed with 1001
    upload_timeout_s: int  # the same for a workspace upload or clone, and to answer it
    workspace_max_files: int  # entries of one workspace an upload or clone may hold
    workspace_idle_ttl_s: int  # a workspace unused this long is deleted
    # Operations (contract section 12; README, "Operate"):
    redis_sentinel_master: str = "mymaster"  # the master's name, when redis_url lists Sentinels
    redis_sentinel_password: str | None = field(default=None, repr=False)  # the Sentinels' own, if any
    metrics_dir: Path | None = None  # PROMETHEUS_MULTIPROC_DIR: each process's metrics, summed per scrape
    worker_metrics_port: int = 9808  # a worker's /metrics; 0: none
    worker_metrics_host: str = "0.0.0.0"
    audit_maxlen: int = 100_000  # audit records kept per tenant (about: XADD MAXLEN ~)
    log_format: str = "text"  # or "json": one object a line
    # Celery task events from the start (`-E`); off, a worker sends them once a monitor asks
    # (Flower does, every few seconds; `celery control enable_events` does): ~1 ms of CPU a call.
    task_events: bool = False
    test_hold_dir: Path | None = None  # tests only: workers/holds.py; unset in production
    # Prepared sandboxes (workers/sandbox/keeper.py): at most this many per worker, 0 for none;
    # each killed when unclaimed for `prepared_idle_s` seconds.
    prepared_sandboxes: int = 4
    prepared_idle_s: float = 10.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, *, require_jwt: bool = True) -> "Settings":
        """`require_jwt=False` for workers, which never verify tokens."""
        env = dict(os.environ if environ is None else environ)
        redis_url = env.get("RUNWARDEN_REDIS_URL", "")
        if not redis_url:
            raise SettingsError("RUNWARDEN_REDIS_URL is not set (runwarden dev sets it for you)")
        secret, public_key, algorithms = _jwt_keys(env) if require_jwt or _has_jwt(env) else (None, None, ())
        sandbox = env.get("RUNWARDEN_SANDBOX", "bwrap")
        if sandbox not in ("bwrap", "none"):
            raise SettingsError(f"RUNWARDEN_SANDBOX must be 'bwrap' or 'none', got {sandbox!r}")
        log_format = env.get("RUNWARDEN_LOG_FORMAT", "") or "text"
        if log_format not in ("text", "json"):
            raise SettingsError(f"RUNWARDEN_LOG_FORMAT must be 'text' or 'json', got {log_format!r}")
        _check_redis_url(redis_url)
        return cls(
            redis_url=redis_url,
            jwt_secret=secret,
            jwt_public_key=public_key,
            jwt_algorithms=algorithms,
            jwt_audience=env.get("RUNWARDEN_JWT_AUDIENCE", "runwarden"),
            jwt_max_lifetime_s=_int(env, "RUNWARDEN_JWT_MAX_LIFETIME", 3600, 1),
            workspaces=Path(env.get("RUNWARDEN_WORKSPACES", "./var/workspaces")).resolve(),
            sandbox=sandbox,
            allowed_origins=_list(env, "RUNWARDEN_ALLOWED_ORIGINS"),
            max_body_bytes=_int(env, "RUNWARDEN_MAX_BODY_BYTES", 2 * 1024 * 1024, 1024),
            output_cap_bytes=_int(env, "RUNWARDEN_OUTPUT_CAP", 64 * 1024 * 1024, 1),
            http_output_bytes=_int(env, "RUNWARDEN_HTTP_OUTPUT_BYTES", 1024 * 1024, 1),
            stream_retention_s=_int(env, "RUNWARDEN_STREAM_RETENTION", 3600, 3600),
            idempotency_ttl_s=_int(env, "RUNWARDEN_IDEMPOTENCY_TTL", 86400, 60),
            wait_file_result_s=_int(env, "RUNWARDEN_FILE_WAIT", 30, 1),
            kill_grace_s=_int(env, "RUNWARDEN_KILL_GRACE_MS", 2000, 0) / 1000,
            sandbox_memory_bytes=_int(env, "RUNWARDEN_SANDBOX_MEMORY", 1024 * 1024 * 1024, 16 * 1024 * 1024),
            sandbox_max_processes=_int(env, "RUNWARDEN_SANDBOX_PROCESSES", 256, 8),
            sandbox_max_file_bytes=_int(env, "RUNWARDEN_SANDBOX_FILE_SIZE", 1024 * 1024 * 1024, 1024),
            sandbox_max_open_files=_int(env, "RUNWARDEN_SANDBOX_OPEN_FILES", 1024, 16),
            sandbox_uid=_int(env, "RUNWARDEN_SANDBOX_UID", 65534, 1),
            visibility_timeout_s=_int(env, "RUNWARDEN_VISIBILITY_TIMEOUT", 3600, 120),
            lease_s=_int(env, "RUNWARDEN_LEASE", 10, 2),
            rate_limit_per_s=_int(env, "RUNWARDEN_RATE_LIMIT", 1000, 1),
            tenant_max_running=_int(env, "RUNWARDEN_TENANT_MAX_RUNNING", 64),
            tenant_calls_per_minute=_int(env, "RUNWARDEN_TENANT_CALLS_PER_MINUTE", 0),
            tenant_output_bytes_per_hour=_int(env, "RUNWARDEN_TENANT_OUTPUT_BYTES_PER_HOUR", 16 * 1024 ** 3),
            tenant_workspace_bytes=_int(env, "RUNWARDEN_TENANT_WORKSPACE_BYTES", 10 * 1024 ** 3),
            placement=_choice(env, "RUNWARDEN_PLACEMENT", ("shared", "node")),
            node=_node(env),
            node_timeout_s=_int(env, "RUNWARDEN_NODE_TIMEOUT", 15, 3),
            public_url=_public_url(env.get("RUNWARDEN_PUBLIC_URL", "")),
            trusted_proxies=_int(env, "RUNWARDEN_TRUSTED_PROXIES", 0, 0),
            # 15 s: a whole request (the largest body, 2 MiB, needs ~1.1 Mbit/s) from an agent
            # platform's servers arrives in milliseconds; a client slower than that holds a thread.
            request_timeout_s=_int(env, "RUNWARDEN_REQUEST_TIMEOUT", 15, 1),
            # 600 s: 10 GiB (the default workspace quota) at ~140 Mbit/s, or a large clone.
            upload_timeout_s=_int(env, "RUNWARDEN_UPLOAD_TIMEOUT", 600, 10),
            workspace_max_files=_int(env, "RUNWARDEN_WORKSPACE_MAX_FILES", 100_000, 1),
            workspace_idle_ttl_s=_int(env, "RUNWARDEN_WORKSPACE_IDLE_TTL", 7 * 86400, 60),
            redis_sentinel_master=env.get("RUNWARDEN_REDIS_SENTINEL_MASTER", "") or "mymaster",
            redis_sentinel_password=env.get("RUNWARDEN_REDIS_SENTINEL_PASSWORD") or None,
            # prometheus-client's own variable (it reads it too, to choose its multiprocess mode).
            metrics_dir=Path(env["PROMETHEUS_MULTIPROC_DIR"]) if env.get("PROMETHEUS_MULTIPROC_DIR") else None,
            worker_metrics_port=_int(env, "RUNWARDEN_WORKER_METRICS_PORT", 9808, 0),
            worker_metrics_host=env.get("RUNWARDEN_WORKER_METRICS_HOST", "") or "0.0.0.0",
            audit_maxlen=_int(env, "RUNWARDEN_AUDIT_MAXLEN", 100_000, 1),
            log_format=log_format,
            task_events=_choice(env, "RUNWARDEN_TASK_EVENTS", ("off", "on")) == "on",
            # 5,000 open streams cost one API process ~85 MiB and no thread (docs/PERFORMANCE.md).
            max_streams=_int(env, "RUNWARDEN_MAX_STREAMS", 5000, 1),
            stream_send_timeout_s=_int(env, "RUNWARDEN_STREAM_SEND_TIMEOUT", 60, 1),
            drain_s=_int(env, "RUNWARDEN_DRAIN_S", 20, 0),
            test_hold_dir=Path(env["RUNWARDEN_TEST_HOLD_DIR"]) if env.get("RUNWARDEN_TEST_HOLD_DIR") else None,
            prepared_sandboxes=_int(env, "RUNWARDEN_PREPARED_SANDBOXES", 4, 0),
            prepared_idle_s=_int(env, "RUNWARDEN_PREPARED_IDLE", 10, 1),
        )

    @property
    def jwt_verify_key(self) -> bytes:
        return self.jwt_public_key if self.jwt_public_key is not None else self.jwt_secret  # type: ignore[return-value]


def _choice(env: dict[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = env.get(name) or choices[0]
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _node(env: dict[str, str]) -> str | None:
    """A worker node's name: also its Celery hostname and part of its queues' names."""
    node = env.get("RUNWARDEN_NODE") or None
    if node is not None and not NAME_RE.fullmatch(node):
        raise SettingsError(f"RUNWARDEN_NODE must match {NAME_RE.pattern}, got {node!r}")
    return node


def _check_redis_url(url: str) -> None:
    """A Sentinel list must name its Sentinels; its text is not echoed (it may hold a password)."""
    try:
        parse_sentinels(url)
    except ValueError as exc:
        raise SettingsError(f"RUNWARDEN_REDIS_URL: {exc}") from None


def _public_url(raw: str) -> str:
    """`http(s)://host[:port][/prefix]`, without its trailing "/"; "" when unset."""
    if not raw:
        return ""
    try:
        parts = urlsplit(raw)
        valid = (parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
                 and "?" not in raw and "#" not in raw and "@" not in parts.netloc
                 and all(ch.isprintable() and not ch.isspace() for ch in raw))
    except ValueError:  # a port that is not a number in range
        valid = False
    if not valid:  # the value is not echoed: it might hold credentials
        raise SettingsError("RUNWARDEN_PUBLIC_URL must be http(s)://host[:port][/path], "
                            "without query, fragment, credentials or spaces")
    return raw.rstrip("/")


def _has_jwt(env: dict[str, str]) -> bool:
    return bool(env.get("RUNWARDEN_JWT_SECRET") or env.get("RUNWARDEN_JWT_PUBLIC_KEY"))


def _jwt_keys(env: dict[str, str]) -> tuple[bytes | None, bytes | None, tuple[str, ...]]:
    """Pin the algorithm family from configuration: HS256, or the asymmetric ones, never both."""
    public_key_path = env.get("RUNWARDEN_JWT_PUBLIC_KEY", "")
    if public_key_path:
        try:
            public_key = Path(public_key_path).read_bytes()
        except OSError as exc:
            raise SettingsError(f"RUNWARDEN_JWT_PUBLIC_KEY cannot be read: {exc.strerror}") from None
        if b"PUBLIC KEY" not in public_key:
            raise SettingsError("RUNWARDEN_JWT_PUBLIC_KEY must be a PEM public key")
        return None, public_key, _asymmetric_algorithm(public_key)
    secret = env.get("RUNWARDEN_JWT_SECRET", "").encode()
    if len(secret) < MIN_HS256_SECRET_BYTES:
        raise SettingsError(
            f"RUNWARDEN_JWT_SECRET must be at least {MIN_HS256_SECRET_BYTES} bytes "
            f"(got {len(secret)}); generate one with: python -c 'import secrets; print(secrets.token_urlsafe(48))'"
        )
    return secret, None, ("HS256",)


def _asymmetric_algorithm(pem: bytes) -> tuple[str, ...]:
    """The one algorithm that fits the key's type, so a token cannot choose another."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, ed448, rsa
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(pem)
    except ValueError:
        raise SettingsError("RUNWARDEN_JWT_PUBLIC_KEY is not a valid PEM public key") from None
    if isinstance(key, rsa.RSAPublicKey):
        return ("RS256",)
    if isinstance(key, ec.EllipticCurvePublicKey):
        return ("ES256",)
    if isinstance(key, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
        return ("EdDSA",)
    raise SettingsError("RUNWARDEN_JWT_PUBLIC_KEY must be an RSA, EC or Ed25519 key")
