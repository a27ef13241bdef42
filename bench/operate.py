"""The dashboard's series (deploy/grafana/runwarden.json), drawn from a real run's scrapes.

    python -m bench.operate [--seconds 90] [--out docs/operate-dashboard.png]

Starts the stack `runwarden dev` runs (Redis, one worker with prefork -c 2, gunicorn), drives a short
mixed load (shell calls of a few lengths, some exiting non-zero, file reads and patches, a read of a
missing file, cancels of queued calls, retries that replay, a tenant at its max_running quota, open
streams), scrapes the API's /metrics and the worker's once a second, and draws the dashboard's
panels with matplotlib (the bench extra) from those scrapes: what Grafana would show, as a picture.
A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import random
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import requests
import websocket
from prometheus_client.parser import text_string_to_metric_families

from runwarden import devstack
from shared import tenants, tokens

Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]
SCOPES = ["files:read", "files:write", "shell:exec"]


class Load:
    """Agents making calls until told to stop, each as an agent would: one call after another."""

    def __init__(self, base: str, secret: str, stop: threading.Event) -> None:
        self.base, self.secret, self.stop = base, secret, stop
        self.rng = random.Random(14)

    def token(self, tenant: str) -> str:
        return tokens.mint(self.secret.encode(), tenant=tenant, run_id="r1", sub="bench-agent", scopes=SCOPES,
                           paths=["**"], ttl_s=3600)

    def post(self, http: requests.Session, token: str, tool: str, params: dict[str, Any], *, key: str | None = None,
             wait: int | None = 30, call_id: str | None = None) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": key or uuid.uuid4().hex,
                   "Content-Type": "application/json", **({"Prefer": f"wait={wait}"} if wait else {})}
        body = {"tool_name": tool, "call_id": call_id or str(uuid.uuid4()), "parameters": params}
        return http.post(f"{self.base}/v1/tool-calls", data=json.dumps(body), headers=headers, timeout=90)

    def agent(self, tenant: str) -> None:
        http, token, rng = requests.Session(), self.token(tenant), random.Random(tenant)
        diff = "--- /dev/null\n+++ b/notes.txt\n@@ -0,0 +1 @@\n+notes\n"
        self.post(http, token, "apply_file_patch", {"path": "notes.txt", "diff": diff, "base_sha": "0" * 40})
        while not self.stop.is_set():
            roll = rng.random()
            if roll < 0.45:
                self.post(http, token, "execute_shell_command",
                          {"command": f"sleep {rng.choice([0.05, 0.2, 0.5, 1.5])}; seq 1 {rng.randrange(1, 2000)}"})
            elif roll < 0.55:
                self.post(http, token, "execute_shell_command", {"command": "echo failing >&2; exit 3"})
            elif roll < 0.8:
                self.post(http, token, "read_file", {"path": rng.choice(["notes.txt"] * 5 + ["missing.txt"])})
            else:
                key, call_id = uuid.uuid4().hex, str(uuid.uuid4())
                for _ in range(2):  # a retry: replayed
                    self.post(http, token, "read_file", {"path": "notes.txt"}, key=key, call_id=call_id)

    def streamer(self, tenant: str) -> None:
        """Shell calls watched over their stream, and a queued one cancelled now and then."""
        http, token = requests.Session(), self.token(tenant)
        while not self.stop.is_set():
            answer = self.post(http, token, "execute_shell_command",
                               {"command": "for i in $(seq 20); do echo line $i; sleep 0.1; done"}, wait=None)
            ws = websocket.create_connection(answer.json()["stream_url"], timeout=60,
                                             header=[f"Authorization: Bearer {token}"], suppress_origin=True)
            queued = self.post(http, token, "execute_shell_command", {"command": "sleep 1"}, wait=None).json()
            http.delete(f"{self.base}/v1/tool-calls/{queued['task_id']}", headers={"Authorization": f"Bearer {token}"},
                        timeout=30)
            while json.loads(ws.recv())["type"] != "exit":
                pass
            ws.close()

    def greedy(self, tenant: str) -> None:
        """A tenant at its max_running quota: every other call it makes is refused with 429."""
        http, token = requests.Session(), self.token(tenant)
        while not self.stop.is_set():
            self.post(http, token, "execute_shell_command", {"command": "sleep 0.5"}, wait=None)
            self.post(http, token, "execute_shell_command", {"command": "true"}, wait=None)
            time.sleep(0.5)


def quietly(job: Callable[[str], None], tenant: str, stop: threading.Event) -> None:
    """A load thread; what fails once the run is over (the stack stopping under it) is not news."""
    try:
        job(tenant)
    except Exception:
        if not stop.is_set():
            raise


def scrape(url: str) -> Scrape:
    text = requests.get(url, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def total(scrape: Scrape, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in scrape.items() if n == name and match.items() <= dict(labels).items())


def by_label(scrapes: list[Scrape], name: str, label: str) -> set[str]:
    return {dict(labels)[label] for s in scrapes for (n, labels) in s if n == name and label in dict(labels)}


def rate(scrapes: list[Scrape], times: list[float], name: str, window: int = 10, **match: str) -> list[float]:
    """Per-second increase over the last `window` scrapes (Prometheus's rate, roughly)."""
    values = [total(s, name, **match) for s in scrapes]
    return [(values[i] - values[max(0, i - window)]) / max(1e-9, times[i] - times[max(0, i - window)])
            for i in range(len(values))]


def quantile(scrapes: list[Scrape], name: str, q: float, window: int = 10) -> list[float]:
    """histogram_quantile over the last `window` scrapes' bucket increases (linear within a bucket)."""
    out = []
    for i, now in enumerate(scrapes):
        before = scrapes[max(0, i - window)]
        bounds = sorted({float(dict(l)["le"]) for (n, l) in now if n == f"{name}_bucket"})
        counts = [total(now, f"{name}_bucket", le=_le(b)) - total(before, f"{name}_bucket", le=_le(b)) for b in bounds]
        out.append(_histogram_quantile(q, bounds, counts))
    return out


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def _histogram_quantile(q: float, bounds: list[float], counts: list[float]) -> float:
    if not counts or counts[-1] <= 0:
        return float("nan")
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(1e-9, count - below)
        lower, below = bound, count
    return lower


def run(seconds: int) -> tuple[list[float], list[Scrape]]:
    root, workspaces = Path(tempfile.mkdtemp(prefix="rw-operate-")), devstack.reachable_dir("rw-operate-ws-")
    stack, stop = devstack.Stack(), threading.Event()
    try:
        redis_url = devstack.start_redis(stack, root / "redis")
        secret = secrets.token_urlsafe(48)
        env = devstack.child_env(RUNWARDEN_REDIS_URL=redis_url, RUNWARDEN_JWT_SECRET=secret,
                                 RUNWARDEN_WORKSPACES=str(workspaces))
        devstack.start_worker(stack, env, concurrency=2, name="worker", log=root / "worker.log")
        port = devstack.free_port()
        devstack.start_api(stack, env, "127.0.0.1", port, log=root / "api.log")
        base = f"http://127.0.0.1:{port}"
        devstack.wait_for(lambda: devstack.http_ok(f"{base}/readyz"), 90, "the stack", stack)
        tenants.set_overrides(redis.Redis.from_url(redis_url), "greedy", {"max_running": 1})
        load = Load(base, secret, stop)
        jobs: list[tuple[Callable[[str], None], str]] = [(load.agent, f"agent{i}") for i in range(4)]
        jobs += [(load.streamer, "streamer"), (load.greedy, "greedy")]
        threads = [threading.Thread(target=quietly, args=(job, tenant, stop), daemon=True) for job, tenant in jobs]
        urls = [stack.metrics["api"], stack.metrics["worker"]]
        times, scrapes, started = [], [], time.monotonic()
        for thread in threads:
            thread.start()
        while (now := time.monotonic() - started) < seconds:
            merged: Scrape = {}
            for url in urls:  # the series of both sides, as Prometheus's sum() over jobs sees them
                for key, value in scrape(url).items():
                    merged[key] = merged.get(key, 0.0) + value
            times.append(now)
            scrapes.append(merged)
            time.sleep(max(0.0, len(times) - (time.monotonic() - started)))
        return times, scrapes
    finally:
        stop.set()
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(workspaces, ignore_errors=True)


def draw(times: list[float], scrapes: list[Scrape], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(14, 13), sharex=True)
    calls = "runwarden_tool_calls_total"
    panels: list[tuple[str, str, dict[str, list[float]]]] = [
        ("Calls by outcome", "calls/s", {o: rate(scrapes, times, calls, outcome=o)
                                         for o in sorted(by_label(scrapes, calls, "outcome"))}),
        ("Calls by tool", "calls/s", {t: rate(scrapes, times, calls, tool=t)
                                      for t in sorted(by_label(scrapes, calls, "tool"))}),
        ("Call duration (POST to outcome)", "s", {f"p{int(q * 100)}": quantile(
            scrapes, "runwarden_tool_call_duration_seconds", q) for q in (0.5, 0.9, 0.99)}),
        ("Queue wait (accepted to started)", "s", {f"p{int(q * 100)}": quantile(
            scrapes, "runwarden_queue_wait_seconds", q) for q in (0.5, 0.9, 0.99)}),
        ("Open streams", "streams", {"open": [total(s, "runwarden_streams_open") for s in scrapes]}),
        ("Output relayed", "bytes/s", {st: rate(scrapes, times, "runwarden_stream_bytes_total", stream=st)
                                       for st in ("stdout", "stderr")}),
        ("Quota refusals and sandbox failures", "per s", {
            **{f"quota {q}": rate(scrapes, times, "runwarden_quota_refusals_total", quota=q)
               for q in sorted(by_label(scrapes, "runwarden_quota_refusals_total", "quota"))},
            "sandbox failures": rate(scrapes, times, "runwarden_sandbox_failures_total")}),
        ("Idempotency", "per s", {r: rate(scrapes, times, "runwarden_idempotency_total", result=r)
                                  for r in sorted(by_label(scrapes, "runwarden_idempotency_total", "result"))}),
    ]
    for axis, (title, unit, series) in zip(axes.flat, panels):
        for label, values in series.items():
            axis.plot(times, values, label=label)
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left", fontsize=8)
    for axis in axes[-1]:
        axis.set_xlabel("seconds into the run")
    fig.suptitle("runwarden: the dashboard's series from a bench run (python -m bench.operate)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.operate")
    parser.add_argument("--seconds", type=int, default=90)
    parser.add_argument("--out", type=Path, default=Path("docs/operate-dashboard.png"))
    args = parser.parse_args()
    times, scrapes = run(args.seconds)
    draw(times, scrapes, args.out)
    last = scrapes[-1]
    print(f"{len(scrapes)} scrapes; calls ended: {int(total(last, 'runwarden_tool_calls_total'))}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
