"""Operator commands: `runwarden token mint|revoke`, `runwarden tenant set|show`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import redis

from shared import revocations, tenants, tokens
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
    revocations.revoke(redis.Redis.from_url(settings.redis_url), args.jti, args.ttl)
    print(f"revoked {args.jti}")
    return 0


def run_tenant(args: argparse.Namespace) -> int:
    """`tenant set T --max-running N …` stores overrides; both print the tenant's quotas as JSON."""
    settings = Settings.from_env(require_jwt=False)
    client = redis.Redis.from_url(settings.redis_url)
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
