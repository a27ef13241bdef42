"""Fair scheduling, measured: tenant B's one-call latency on an idle pool, then while tenant A holds
1,000 queued calls (`sleep 0.2` each), on the stack `runwarden dev` runs (one worker, prefork -c 2).

    python -m bench.fairness [--backlog 1000] [--samples 30]

Goal (issue 13): B's p50 under load <= its idle p50 + one A call's duration. Prints a markdown table
and writes bench/results/fairness.json. A benchmark, not a test: nothing here fails on a time.
"""
from __future__ import annotations

import argparse
import json
import random
import secrets
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import requests

from runwarden import devstack
from shared import keys, tenants, tokens

A_COMMAND = "sleep 0.2"


def post_shell(http: requests.Session, base: str, token: str, command: str, wait: int | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": uuid.uuid4().hex,
               "Content-Type": "application/json", **({"Prefer": f"wait={wait}"} if wait else {})}
    body = {"tool_name": "execute_shell_command", "call_id": str(uuid.uuid4()), "parameters": {"command": command}}
    response = http.post(f"{base}/v1/tool-calls", data=json.dumps(body), headers=headers, timeout=120)
    response.raise_for_status()
    return dict(response.json())


def b_latencies(base: str, token: str, samples: int, command: str = "echo hi") -> list[float]:
    """End-to-end latencies of `command`, one at a time, after a think time of 0-250 ms each (an
    agent's model between two calls): back to back, B would arrive in step with A's calls."""
    http, out, think = requests.Session(), [], random.Random(7)
    for _ in range(samples):
        time.sleep(think.uniform(0, 0.25))
        started = time.perf_counter()
        answer = post_shell(http, base, token, command, wait=60)
        assert answer["status"] == "completed", answer
        out.append((time.perf_counter() - started) * 1000)
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(backlog: int, samples: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="rw-fair-"))
    workspaces = devstack.reachable_dir("rw-fair-ws-")
    stack = devstack.Stack()
    try:
        redis_url = devstack.start_redis(stack, root / "redis")
        secret = secrets.token_urlsafe(48)
        env = devstack.child_env(RUNWARDEN_REDIS_URL=redis_url, RUNWARDEN_JWT_SECRET=secret,
                                 RUNWARDEN_WORKSPACES=str(workspaces), RUNWARDEN_RATE_LIMIT="1000000")
        devstack.start_worker(stack, env, concurrency=2, name="fair", log=root / "worker.log")
        port = devstack.free_port()
        devstack.start_api(stack, env, "127.0.0.1", port, log=root / "api.log")
        base = f"http://127.0.0.1:{port}"
        devstack.wait_for(lambda: devstack.http_ok(f"{base}/readyz"), 90, "the stack", stack)
        tenants.set_overrides(redis.Redis.from_url(redis_url), "tenant-a", {"max_running": backlog + 100})
        token_a, token_b = (tokens.mint(secret.encode(), tenant=t, run_id="r1", sub="bench", scopes=["shell:exec"],
                                        paths=["**"], ttl_s=3600) for t in ("tenant-a", "tenant-b"))
        b_latencies(base, token_b, 5)  # warm-up
        idle = b_latencies(base, token_b, samples)
        http = requests.Session()
        a_once = b_latencies(base, token_a, 5, A_COMMAND)  # an A call alone, end to end
        started = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda _: post_shell(http, base, token_a, A_COMMAND, None), range(backlog)))
        submit_s = time.perf_counter() - started
        loaded = b_latencies(base, token_b, samples)
        held = int(redis.Redis.from_url(redis_url).scard(keys.tenant_active("tenant-a")))
    finally:
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(workspaces, ignore_errors=True)
    a_call_ms = statistics.median(a_once)
    return {"backlog": backlog, "a_queued_at_end": held, "submit_s": round(submit_s, 1),
            "idle_p50": quantile(idle, 0.5), "idle_p99": quantile(idle, 0.99),
            "loaded_p50": quantile(loaded, 0.5), "loaded_p99": quantile(loaded, 0.99),
            "a_call_ms": a_call_ms, "goal_p50": quantile(idle, 0.5) + a_call_ms,
            "met": quantile(loaded, 0.5) <= quantile(idle, 0.5) + a_call_ms, "idle": idle, "loaded": loaded}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fairness")
    parser.add_argument("--backlog", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    result = run(args.backlog, args.samples)
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fairness.json").write_text(json.dumps(result, indent=1))
    print("| tenant B's `echo hi`, `Prefer: wait` | p50 ms | p99 ms |\n| --- | --: | --: |")
    print(f"| idle pool | {result['idle_p50']:.1f} | {result['idle_p99']:.1f} |")
    print(f"| tenant A holding {result['backlog']} queued `{A_COMMAND}` calls | {result['loaded_p50']:.1f} | "
          f"{result['loaded_p99']:.1f} |")
    print(f"\none A call end to end: {result['a_call_ms']:.1f} ms; goal p50 <= {result['goal_p50']:.1f} ms: "
          f"{'met' if result['met'] else 'NOT met'}; A still had {result['a_queued_at_end']} calls queued or running "
          f"when B's samples ended")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
