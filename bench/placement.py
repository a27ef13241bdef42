"""Node placement on paper, against a real Redis: what routing costs per call, how 1,000 runs of
uneven activity spread over the nodes, and what a node's death takes with it.

    python -m bench.placement [--nodes 4] [--runs 1000] [--claims 3000]

The claim script (shared/idempotency.py) is what every call runs in Redis; under node placement it
also looks the run's node up (and places a new run), in the same round trip. Its cost is measured
by timing the claim itself in both modes on the same Redis. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from runwarden import devstack
from shared import keys
from shared.idempotency import Idempotency
from shared.placement import Placement
from shared.tenants import Quotas

QUOTAS = Quotas(max_running=0, calls_per_minute=0, output_bytes_per_hour=0, workspace_bytes=0)


def q(values: list[float], fraction: float) -> float:
    return sorted(values)[int(fraction * (len(values) - 1))]


def claim_ms(client: redis.Redis, node_placement: bool, runs: list[tuple[str, str]], count: int) -> list[float]:
    store = Idempotency(client, 3600, 10**9, QUOTAS, node_placement)
    out = []
    for index in range(count):
        tenant, run_id = runs[index % len(runs)]
        started = time.perf_counter()
        store.claim(tenant=tenant, key=uuid.uuid4().hex, fp="f" * 64, run_id=run_id, call_id=str(uuid.uuid4()),
                    tool_name="read_file", created_ms=int(time.time() * 1000), queue=keys.FILE_QUEUE)
        out.append((time.perf_counter() - started) * 1000)
    return out


def spread(client: redis.Redis, nodes: list[str], runs: list[tuple[str, str]]) -> dict[str, Any]:
    placement = Placement(client)
    where = {run: placement.place(*run) for run in runs}
    activity = random.Random(1)
    calls = {run: int(activity.paretovariate(1.2)) for run in runs}  # a few runs make most calls
    per_node_runs = {n: sum(1 for r in runs if where[r] == n) for n in nodes}
    per_node_calls = {n: sum(calls[r] for r in runs if where[r] == n) for n in nodes}
    loads = list(per_node_calls.values())
    return {"runs": per_node_runs, "calls": per_node_calls, "calls_total": sum(loads),
            "calls_cv": statistics.pstdev(loads) / statistics.mean(loads),
            "busiest_share": max(loads) / sum(loads), "dead_node_runs": per_node_runs[nodes[0]]}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--claims", type=int, default=3000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rw-place-"))
    stack = devstack.Stack()
    try:
        client = redis.Redis.from_url(devstack.start_redis(stack, root / "redis"))
        nodes = [f"node{i}" for i in range(1, args.nodes + 1)]
        for node in nodes:
            Placement(client).heartbeat(node, 3600)
        runs = [(f"t{i % 50}", f"r{i}") for i in range(args.runs)]
        result = spread(client, nodes, runs)
        claim_ms(client, True, runs, 500)  # warm-up, both modes
        claim_ms(client, False, runs, 500)
        shared, node = claim_ms(client, False, runs, args.claims), claim_ms(client, True, runs, args.claims)
    finally:
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("| claim script, one call, in Redis + loopback | p50 ms | p99 ms |\n| --- | --: | --: |")
    print(f"| shared placement | {q(shared, .5):.3f} | {q(shared, .99):.3f} |")
    print(f"| node placement (the run's node looked up) | {q(node, .5):.3f} | {q(node, .99):.3f} |")
    print(f"\n{args.runs} runs over {args.nodes} nodes: runs per node {result['runs']}; calls per node "
          f"(Pareto activity, {result['calls_total']} calls) {result['calls']}, coefficient of variation "
          f"{result['calls_cv']:.2f}, busiest node {result['busiest_share']:.0%} of the calls; a node's "
          f"death makes its {result['dead_node_runs']} runs ({result['dead_node_runs'] / args.runs:.0%}) "
          f"answer 503 until it is back.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
