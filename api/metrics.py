"""Prometheus metrics the API process measures, served with every process's at /metrics."""
from __future__ import annotations

import time

from flask import Flask, Response, g, request
from prometheus_client import Counter, Gauge, Histogram

from shared import metrics
from shared.settings import Settings

REQUESTS = Counter("runwarden_http_requests_total", "HTTP requests by route and status",
                   ["method", "route", "status"])
LATENCY = Histogram("runwarden_http_request_seconds", "HTTP request latency by route", ["method", "route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
# livesum: the processes alive now (a dead one's streams are gone with it; see forget_dead_processes).
STREAMS_OPEN = Gauge("runwarden_streams_open", "WebSocket output streams open", multiprocess_mode="livesum")
IDEMPOTENCY = Counter("runwarden_idempotency_total",
                      "Idempotency-Key outcomes: claimed (a new call), replayed, in_use (409), reused (422)",
                      ["result"])
QUOTA_REFUSALS = Counter("runwarden_quota_refusals_total",
                         "Calls refused with 429, by the quota spent (rate_limit: the per-second rate)", ["quota"])
QUOTAS = frozenset({"max_running", "calls_per_minute", "output_bytes_per_hour", "workspace_bytes", "rate_limit"})


def init_app(app: Flask, settings: Settings) -> None:
    # This process starts: the live gauges of the processes before it (a gunicorn worker replaced) go.
    metrics.forget_dead_processes(settings.metrics_dir)

    @app.before_request
    def start_timer() -> None:
        g.started = time.perf_counter()

    @app.after_request
    def observe(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule else "unmatched"
        REQUESTS.labels(request.method, route, response.status_code).inc()
        if "started" in g:
            LATENCY.labels(request.method, route).observe(time.perf_counter() - g.started)
        return response


def idempotency(result: str) -> None:
    IDEMPOTENCY.labels(result).inc()


def quota_refused(quota: str) -> None:
    QUOTA_REFUSALS.labels(quota if quota in QUOTAS else "other").inc()


def exposition(settings: Settings) -> Response:
    body, content_type = metrics.exposition(settings.metrics_dir)
    return Response(body, content_type=content_type)
