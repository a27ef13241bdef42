"""`runwarden dev`: Redis, one Celery worker and the API on this machine, each its own process."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from runwarden import devstack
from shared import tokens
from shared.settings import Settings, SettingsError


def start_nodes(stack: devstack.Stack, env: dict[str, str], count: int, concurrency: int,
                logs: Path | None = None) -> list[str]:
    """Node placement on one machine: worker nodes `node1` … `nodeN`, each with its own root
    `<workspaces>/<node>/`, as separate disks would be."""
    names = [f"node{index}" for index in range(1, count + 1)]
    for name in names:
        root = Path(env["RUNWARDEN_WORKSPACES"]) / name
        node_env = {**env, "RUNWARDEN_PLACEMENT": "node", "RUNWARDEN_NODE": name, "RUNWARDEN_WORKSPACES": str(root)}
        devstack.start_worker(stack, node_env, concurrency=concurrency, name=name,
                              log=logs / f"{name}.log" if logs else None)
    return names


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
        if args.nodes:
            env["RUNWARDEN_PLACEMENT"] = "node"
            start_nodes(stack, env, args.nodes, args.concurrency)
        else:
            devstack.start_worker(stack, env, concurrency=args.concurrency, metrics_port=9808)
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
