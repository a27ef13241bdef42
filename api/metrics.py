"""Prometheus metrics of the API process (served at /metrics)."""
from __future__ import annotations

import time

from flask import Flask, Response, g, request
from shared.schema import TOOLS
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)
REQUESTS = Counter("runwarden_http_requests_total", "HTTP requests by route and status",
                   ["method", "route", "status"], registry=REGISTRY)
LATENCY = Histogram("runwarden_http_request_seconds", "HTTP request latency by route", ["method", "route"],
                    registry=REGISTRY,
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
TOOL_CALLS = Counter("runwarden_tool_calls_total", "Tool call answers by tool and status",
                     ["tool", "status"], registry=REGISTRY)
STREAMS_OPEN = Gauge("runwarden_streams_open", "WebSocket streams this API process holds open", registry=REGISTRY)


def init_app(app: Flask) -> None:
    streams = app.extensions["runwarden"].streams
    STREAMS_OPEN.set_function(lambda: streams.admitted)

    @app.before_request
    def start_timer() -> None:
        g.started = time.perf_counter()

    @app.after_request
    def observe(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule else "unmatched"
        REQUESTS.labels(request.method, route, response.status_code).inc()
        if "started" in g:
            LATENCY.labels(request.method, route).observe(time.perf_counter() - g.started)
        if route == "/v1/tool-calls" and request.method == "POST":
            tool = g.get("call_context", {}).get("tool_name")
            TOOL_CALLS.labels(tool if tool in TOOLS else "other", response.status_code).inc()
        return response


def exposition() -> Response:
    return Response(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
