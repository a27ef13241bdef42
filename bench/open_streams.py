"""`python -m bench.open_streams [--sizes 500,2000,5000] [--relay-reps 3] [--out DIR]`: open streams (issue 19).

For each N, on a fresh API process started with RUNWARDEN_MAX_STREAMS=N: POST N calls (`sleep 600`;
two run, the rest queue), open a stream for each with an asyncio client (websockets, so the load
generator is not the limit), then measure the API process (RSS, threads), Redis's client count,
/healthz latency (a fresh connection each, as a probe makes), handshakes beyond the limit (status,
Retry-After, time to the answer), then DELETE every call and check that every stream ended with
exactly one exit event and a 1000 close. Last, the 48 MiB relay against its pub/sub floor (the main
bench's own measurement, alternated). Writes `open_streams.json` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import websockets

from bench import stack as stack_mod
from bench.client import Agent, Http
from bench.stats import summary

RESULTS = Path(__file__).resolve().parent / "results"
OPENING_AT_ONCE = 100  # handshakes in flight from the client at a time
BEYOND = 20  # handshakes tried past the limit
PROBES = 200


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def post_calls(agent: Agent, url: str, n: int) -> list[str]:
    def post(_: int) -> str:
        http = Http(url)
        try:
            return str(agent.post(http, "execute_shell_command", {"command": "sleep 600", "timeout_ms": 60000},
                                  expect=202)["task_id"])
        finally:
            http.close()
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(post, range(n)))


def api_figures(bench: stack_mod.BenchStack) -> dict[str, int]:
    pid = stack_mod.api_worker_pid(bench)
    return {"rss_kib": stack_mod.rss_kib(pid), "threads": stack_mod.status_field(pid, "Threads"),
            "redis_connections": redis_connections(pid, int(bench.redis_url.rsplit(":", 1)[1].split("/")[0]))}


def redis_connections(pid: int, redis_port: int) -> int:
    """Established TCP connections of process `pid` to Redis (its socket inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].split(":")[1], 16) == redis_port and fields[9] in inodes:
                count += 1
    return count


def probe_healthz(url: str) -> list[float]:
    host, port = url.removeprefix("http://").split(":")
    samples = []
    for _ in range(PROBES):
        t0 = time.perf_counter()
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("GET", "/healthz")
        status = connection.getresponse().status
        connection.close()
        samples.append((time.perf_counter() - t0) * 1000)
        assert status == 200, status
    return samples


def beyond_limit(agent: Agent, url: str, task_id: str) -> list[dict[str, Any]]:
    host, port = url.removeprefix("http://").split(":")
    answers = []
    for _ in range(BEYOND):
        t0 = time.perf_counter()
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("GET", f"/v1/tool-calls/{task_id}/stream", headers={
            "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Authorization": f"Bearer {agent.token}"})
        response = connection.getresponse()
        body = response.read() if response.status != 101 else b""
        answers.append({"status": response.status, "ms": (time.perf_counter() - t0) * 1000,
                        "retry_after": response.getheader("Retry-After"),
                        "content_type": response.getheader("Content-Type"),
                        "code": json.loads(body).get("code") if body else None})
        connection.close()
    return answers


async def open_all(agent: Agent, task_ids: list[str]) -> tuple[list[Any], list[str]]:
    limit = asyncio.Semaphore(OPENING_AT_ONCE)
    failures: list[str] = []

    async def one(task_id: str) -> Any:
        async with limit:
            try:
                return await websockets.connect(f"{agent.ws_base}/v1/tool-calls/{task_id}/stream", open_timeout=60,
                                                additional_headers={"Authorization": f"Bearer {agent.token}"},
                                                ping_interval=None, max_size=None)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                failures.append(f"{type(exc).__name__}: {exc}"[:200])
                return None
    opened = await asyncio.gather(*(one(task_id) for task_id in task_ids))
    return [ws for ws in opened if ws is not None], failures


async def read_to_end(ws: Any) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    try:
        async for message in ws:
            events.append(json.loads(message))
    except websockets.ConnectionClosed:
        pass
    exits = [e for e in events if e["type"] == "exit"]
    return {"one_exit_last": len(exits) == 1 and events[-1] is exits[0], "close": ws.close_code}


def cancel_all(agent: Agent, url: str, task_ids: list[str]) -> dict[str, int]:
    statuses: dict[str, int] = {}

    def cancel(chunk: list[str]) -> None:
        http = Http(url)
        for task_id in chunk:
            status = str(agent.delete(http, task_id))
            statuses[status] = statuses.get(status, 0) + 1
        http.close()
    chunks = [task_ids[i::16] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(cancel, chunks))
    return statuses


async def hold(bench: stack_mod.BenchStack, agent: Agent, task_ids: list[str]) -> dict[str, Any]:
    """Open every stream, measure while they are open, then cancel every call and read every stream out."""
    url, n = bench.api_url, len(task_ids)
    # Warm-up: as many handshakes at once as the opening will have, so that the thread pool and the
    # Redis pool they grow (per handshake in flight, not per stream) are there in "before" already.
    warm, _ = await open_all(agent, task_ids[:OPENING_AT_ONCE])
    for ws in warm:
        await ws.close()
    await asyncio.sleep(2)
    before = api_figures(bench)
    t0 = time.perf_counter()
    streams, failures = await open_all(agent, task_ids)
    open_s = time.perf_counter() - t0
    await asyncio.sleep(3)  # let the readers settle (the quiet reader takes every stream within a second)
    during = api_figures(bench)
    health = summary(await asyncio.to_thread(probe_healthz, url))
    refused = await asyncio.to_thread(beyond_limit, agent, url, task_ids[0])
    readers = [asyncio.create_task(read_to_end(ws)) for ws in streams]
    t1 = time.perf_counter()
    cancels = await asyncio.to_thread(cancel_all, agent, url, task_ids)
    ends = await asyncio.gather(*readers)
    end_s = time.perf_counter() - t1
    await asyncio.sleep(2)
    after = api_figures(bench)
    return {
        "streams": n, "opened": len(streams), "open_failures": len(failures), "open_failure_examples": failures[:3],
        "open_s": round(open_s, 1), "before": before, "with_streams": during, "after_close": after,
        "per_stream_kib": (during["rss_kib"] - before["rss_kib"]) / max(1, len(streams)),
        "healthz_ms": health,
        "beyond_limit": {"statuses": sorted({a["status"] for a in refused}),
                         "max_ms": max(a["ms"] for a in refused),
                         "retry_after": sorted({str(a["retry_after"]) for a in refused}),
                         "problem_json": all(a["content_type"] == "application/problem+json" for a in refused),
                         "codes": sorted({str(a["code"]) for a in refused})},
        "cancel_statuses": cancels, "cancel_to_last_exit_s": round(end_s, 1),
        "ended_with_one_exit_and_1000": sum(1 for e in ends if e["one_exit_last"] and e["close"] == 1000),
    }


def measure(bench: stack_mod.BenchStack, n: int) -> dict[str, Any]:
    stack_mod.restart_api(bench, RUNWARDEN_MAX_STREAMS=str(n))
    agent = Agent(bench.api_url, bench.secret)
    t0 = time.perf_counter()
    task_ids = post_calls(agent, bench.api_url, n)
    log(f"  N={n}: {n} calls posted in {time.perf_counter() - t0:.1f} s")
    result = asyncio.run(hold(bench, agent, task_ids))
    for task_id in task_ids:  # free Redis of the logs
        bench.redis.delete(f"rw:log:{task_id}")
    log(f"  N={n}: {result['opened']} open in {result['open_s']} s; RSS {result['before']['rss_kib'] / 1024:.0f} → "
        f"{result['with_streams']['rss_kib'] / 1024:.0f} MiB ({result['per_stream_kib']:.1f} KiB each), threads "
        f"{result['before']['threads']} → {result['with_streams']['threads']}, API's Redis connections "
        f"{result['before']['redis_connections']} → {result['with_streams']['redis_connections']}; /healthz p50 "
        f"{result['healthz_ms']['p50']:.1f} p99 {result['healthz_ms']['p99']:.1f} ms; beyond the limit "
        f"{result['beyond_limit']}; {result['ended_with_one_exit_and_1000']}/{n} ended with their exit "
        f"{result['cancel_to_last_exit_s']} s after the cancels began")
    return result


def relay(bench: stack_mod.BenchStack, reps: int) -> dict[str, Any]:
    from bench.run import FULL, Bench
    stack_mod.restart_api(bench)
    runner = Bench(bench, FULL, RESULTS, profiling=False)
    floor, product = [], []
    for _ in range(reps):
        floor.append(runner.relay_floor_once(FULL.relay_bytes)["mb_per_s"])
        product.append(runner.relay_rw_once(FULL.relay_bytes)["mb_per_s"])
        log(f"  relay: pub/sub floor {floor[-1]:.0f} MB/s, runwarden {product[-1]:.0f} MB/s")
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return {"floor_mb_per_s": floor, "runwarden_mb_per_s": product, "ratio": median(product) / median(floor)}


def markdown(results: dict[str, Any]) -> str:
    rows = ["| N | opened | open time | API RSS before → with (per stream) | threads | API's Redis connections | "
            "/healthz p50 / p95 / max | beyond the limit | cancel → every exit | ended with exit + 1000 |",
            "| --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |"]
    for r in results["sizes"]:
        b, w, h, x = r["before"], r["with_streams"], r["healthz_ms"], r["beyond_limit"]
        rows.append(
            f"| {r['streams']:,} | {r['opened']:,} | {r['open_s']} s | {b['rss_kib'] / 1024:.0f} → "
            f"{w['rss_kib'] / 1024:.0f} MiB ({r['per_stream_kib']:.1f} KiB) | {b['threads']} → {w['threads']} | "
            f"{b['redis_connections']} → {w['redis_connections']} | {h['p50']:.1f} / {h['p95']:.1f} / "
            f"{h['max']:.1f} ms | {x['statuses']} in ≤ {x['max_ms']:.0f} ms, Retry-After {x['retry_after']} | "
            f"{r['cancel_to_last_exit_s']} s | {r['ended_with_one_exit_and_1000']:,} |")
    if "relay" in results:
        relay_result = results["relay"]
        rows.append(f"\nRelay, one 48 MiB stream: runwarden {relay_result['runwarden_mb_per_s']} MB/s against the "
                    f"pub/sub floor {relay_result['floor_mb_per_s']} MB/s: ratio {relay_result['ratio']:.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.open_streams", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="500,2000,5000", help='comma-separated N; "" for the relay alone')
    parser.add_argument("--relay-reps", type=int, default=3, help="0 skips the relay")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = stack_mod.start(args.out / "logs", RUNWARDEN_TENANT_MAX_RUNNING="100000")
    results: dict[str, Any] = {"sizes": []}
    try:
        for n in (int(size) for size in args.sizes.split(",") if size):
            results["sizes"].append(measure(bench, n))
        if args.relay_reps:
            results["relay"] = relay(bench, args.relay_reps)
    finally:
        bench.stop()
    (args.out / "open_streams.json").write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
