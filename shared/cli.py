"""`runwarden dev` (the whole stack on one machine), `runwarden token mint|revoke` and
`runwarden call read|patch|sh` (the Python client's CLI, `runwarden_client.cli`)."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from runwarden_client import cli as client_cli
from shared import devstack, tokens
from shared.settings import Settings, SettingsError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runwarden", description="Sandboxed tool calls for AI coding agents.")
    commands = parser.add_subparsers(dest="command", required=True)

    dev = commands.add_parser("dev", help="run Redis, one Celery worker and the API on this machine")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=8080)
    dev.add_argument("--workspaces", type=Path, default=None)
    dev.add_argument("--concurrency", type=int, default=2, help="worker pool processes")

    token = commands.add_parser("token", help="tokens").add_subparsers(dest="token_command", required=True)
    mint = token.add_parser("mint", help="print a signed token (needs RUNWARDEN_JWT_SECRET)")
    mint.add_argument("--tenant", required=True)
    mint.add_argument("--run", required=True)
    mint.add_argument("--sub", required=True)
    mint.add_argument("--scope", action="append", required=True, choices=tokens.SCOPES)
    mint.add_argument("--path", action="append", default=None, help="glob in allowed_paths (default: **)")
    mint.add_argument("--command", dest="commands", action="append", default=None,
                      help="program name for allowed_commands (repeat)")
    mint.add_argument("--ttl", type=int, default=900, help="seconds (default 900)")
    revoke = token.add_parser("revoke", help="revoke a token id (jti) until it would have expired")
    revoke.add_argument("jti")
    revoke.add_argument("--ttl", type=int, default=3600)

    call = commands.add_parser("call", help="make one tool call: read, patch or sh (RUNWARDEN_URL, RUNWARDEN_TOKEN)")
    client_cli.add_arguments(call)

    args = parser.parse_args(argv)
    if args.command == "dev":
        return run_dev(args)
    if args.command == "call":
        return client_cli.run(args)
    if args.token_command == "mint":
        return run_mint(args)
    return run_revoke(args)


def run_mint(args: argparse.Namespace) -> int:
    secret = os.environ.get("RUNWARDEN_JWT_SECRET", "").encode()
    if len(secret) < 32:
        print("runwarden: set RUNWARDEN_JWT_SECRET (at least 32 bytes) to mint tokens", file=sys.stderr)
        return 2
    print(tokens.mint(secret, tenant=args.tenant, run_id=args.run, sub=args.sub, scopes=args.scope,
                      paths=args.path or ["**"], ttl_s=args.ttl, commands=args.commands,
                      audience=os.environ.get("RUNWARDEN_JWT_AUDIENCE", "runwarden")))
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    import redis

    from shared import keys

    settings = Settings.from_env()
    redis.Redis.from_url(settings.redis_url).set(keys.revoked_jti(args.jti), "1", ex=args.ttl)
    print(f"revoked {args.jti}")
    return 0


def run_dev(args: argparse.Namespace) -> int:
    var = Path("var").resolve()
    env = os.environ.copy()
    env.setdefault("RUNWARDEN_WORKSPACES", str((args.workspaces or var / "workspaces").resolve()))
    if args.workspaces:
        env["RUNWARDEN_WORKSPACES"] = str(args.workspaces.resolve())
    generated_secret = "RUNWARDEN_JWT_SECRET" not in env and "RUNWARDEN_JWT_PUBLIC_KEY" not in env
    if generated_secret:
        env["RUNWARDEN_JWT_SECRET"] = secrets.token_urlsafe(48)
    stack = devstack.Stack()
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        if not env.get("RUNWARDEN_REDIS_URL"):
            env["RUNWARDEN_REDIS_URL"] = devstack.start_redis(stack, var / "redis")
        try:
            Settings.from_env(env)  # refuse a bad configuration before starting anything else
        except SettingsError as exc:
            print(f"runwarden: {exc}", file=sys.stderr)
            return 2
        devstack.start_worker(stack, env, concurrency=args.concurrency)
        devstack.start_api(stack, env, args.host, args.port)
        base = f"http://{args.host}:{args.port}"
        devstack.wait_for(lambda: stopping or devstack.http_ok(f"{base}/readyz"), 120, "the API", stack)
        if stopping:
            return 0
        if generated_secret:
            _print_dev_help(env, base)
        print(f"runwarden ready {base}", flush=True)
        while not stopping:
            if death := stack.died():
                print(f"runwarden: {death}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except RuntimeError as exc:
        print(f"runwarden: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


def _print_dev_help(env: dict[str, str], base: str) -> None:
    token = tokens.mint(env["RUNWARDEN_JWT_SECRET"].encode(), tenant="dev", run_id="run1", sub="dev-agent",
                        scopes=["files:read", "files:write", "shell:exec"], paths=["**"], ttl_s=3600)
    print(f"RUNWARDEN_JWT_SECRET={env['RUNWARDEN_JWT_SECRET']}  (generated for this dev session)")
    print(f"RUNWARDEN_REDIS_URL={env['RUNWARDEN_REDIS_URL']}")
    print("Try it (a dev token for tenant 'dev', run 'run1', valid 1 hour):")
    print(f"  curl -s {base}/v1/tool-calls -H 'Authorization: Bearer {token}' \\\n"
          f"    -H \"Idempotency-Key: $(uuidgen || cat /proc/sys/kernel/random/uuid)\" -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"tool_name\":\"execute_shell_command\",\"call_id\":\"'$(cat /proc/sys/kernel/random/uuid)'\","
          f"\"parameters\":{{\"command\":\"echo hello\"}}}}' -H 'Prefer: wait=10'", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
