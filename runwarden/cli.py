"""The `runwarden` command: one parser, a module per noun (`dev`, `admin` for token, tenant and
audit, `workspaces`, and the Python client's `call`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from runwarden import admin, dev as dev_stack, workspaces
from runwarden_client import cli as client_cli
from shared import audit, tokens
from shared.tenants import Quotas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runwarden", description="Sandboxed tool calls for AI coding agents.")
    commands = parser.add_subparsers(dest="command", required=True)

    dev = commands.add_parser("dev", help="run Redis, one Celery worker and the API on this machine")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=8080)
    dev.add_argument("--workspaces", type=Path, default=None)
    dev.add_argument("--concurrency", type=int, default=2, help="worker pool processes")
    dev.add_argument("--nodes", type=int, default=0, metavar="N",
                     help="N worker nodes node1…nodeN with their own workspaces roots (RUNWARDEN_PLACEMENT=node)")

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

    tenant = commands.add_parser("tenant", help="tenant quotas (needs RUNWARDEN_REDIS_URL)").add_subparsers(
        dest="tenant_command", required=True)
    set_quotas = tenant.add_parser("set", help="override quotas (0: unlimited); applies from the next call")
    set_quotas.add_argument("tenant")
    for name in Quotas.names():
        set_quotas.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None, metavar="N")
    tenant.add_parser("show", help="the tenant's quotas and which are overrides").add_argument("tenant")

    workspaces.add_arguments(commands.add_parser(
        "workspace", help="create, list or delete workspaces (RUNWARDEN_URL, RUNWARDEN_TOKEN with workspaces:admin)"))
    trail = commands.add_parser("audit", help="a tenant's audit trail as JSON lines (needs RUNWARDEN_REDIS_URL)")
    trail.add_argument("--tenant", required=True)
    trail.add_argument("--since", default=None, help="an ISO 8601 time, or seconds before now (86400: a day)")
    trail.add_argument("--limit", type=int, default=audit.DEFAULT_LIMIT, metavar="N")

    call = commands.add_parser("call", help="make one tool call: read, patch or sh (RUNWARDEN_URL, RUNWARDEN_TOKEN)")
    client_cli.add_arguments(call)

    args = parser.parse_args(argv)
    if args.command == "dev":
        return dev_stack.run_dev(args)
    if args.command == "call":
        return client_cli.run(args)
    if args.command == "tenant":
        return admin.run_tenant(args)
    if args.command == "workspace":
        return workspaces.run(args)
    if args.command == "audit":
        return admin.run_audit(args)
    if args.token_command == "mint":
        return admin.run_mint(args)
    return admin.run_revoke(args)


if __name__ == "__main__":
    raise SystemExit(main())
