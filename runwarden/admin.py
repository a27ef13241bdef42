"""Operator commands: `runwarden token mint|revoke`, `runwarden tenant set|show`, `runwarden audit`."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict


from shared import audit, connections, revocations, tenants, tokens
from shared.settings import Settings
from shared.tenants import Quotas


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
    settings = Settings.from_env()
    revocations.revoke(connections.connect(settings, socket_timeout=10), args.jti, args.ttl)
    print(f"revoked {args.jti}")
    return 0


def run_tenant(args: argparse.Namespace) -> int:
    """`tenant set T --max-running N …` stores overrides; both print the tenant's quotas as JSON."""
    settings = Settings.from_env(require_jwt=False)
    client = connections.connect(settings, socket_timeout=10)
    if args.tenant_command == "set":
        values = {name: getattr(args, name) for name in Quotas.names() if getattr(args, name) is not None}
        try:
            tenants.set_overrides(client, args.tenant, values)
        except ValueError as exc:
            print(f"runwarden: {exc}", file=sys.stderr)
            return 2
    quotas = asdict(tenants.effective(client, settings, args.tenant))
    print(json.dumps({"tenant": args.tenant, "quotas": quotas,
                      "overrides": sorted(tenants.overrides(client, args.tenant))}))
    return 0


def run_audit(args: argparse.Namespace) -> int:
    """`audit --tenant T [--since …] [--limit N]`: the tenant's records, oldest first, one JSON a line."""
    settings = Settings.from_env(require_jwt=False)
    try:
        since_ms = audit.parse_since(args.since, int(time.time() * 1000))
    except (ValueError, OverflowError):
        print("runwarden: --since must be an ISO 8601 time or a number of seconds", file=sys.stderr)
        return 2
    if not 0 < args.limit <= audit.MAX_LIMIT:
        print(f"runwarden: --limit must be from 1 to {audit.MAX_LIMIT}", file=sys.stderr)
        return 2
    records = audit.read(connections.connect(settings, socket_timeout=10), args.tenant, since_ms, args.limit)
    sys.stdout.write(audit.json_lines(records))
    return 0
