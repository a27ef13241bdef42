"""Prometheus metrics a worker measures, and its exporter (RUNWARDEN_WORKER_METRICS_PORT).

The exporter is a thread of the worker's main process; the pool processes count in their own
files of PROMETHEUS_MULTIPROC_DIR, and each scrape sums them (shared/metrics.py). A worker starts
with a clean directory: what processes of an earlier run left is dropped at `worker_init`.
"""
from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import Counter, Histogram

from shared import metrics
from shared.settings import Settings

log = logging.getLogger("runwarden.worker")

QUEUE_WAIT = Histogram("runwarden_queue_wait_seconds", "Seconds from a call's acceptance to its start on a worker",
                       ["tool"], buckets=metrics.WAIT_BUCKETS)
STREAM_BYTES = Counter("runwarden_stream_bytes_total", "Bytes of command output relayed into output streams",
                       ["stream"])
SANDBOX_STARTS = Counter("runwarden_sandbox_starts_total",
                         "Shell calls by how their sandbox started: prepared ahead of the call by the keeper, or cold",
                         ["how"])
SANDBOX_FAILURES = Counter("runwarden_sandbox_failures_total",
                           "Shell calls refused because the sandbox would not start (and failed self-tests)")


def call_started(tool: str, queue_wait_s: float | None) -> None:
    if queue_wait_s is not None:
        QUEUE_WAIT.labels(metrics.tool_label(tool)).observe(queue_wait_s)


def output_relayed(result: dict[str, Any]) -> None:
    for stream in ("stdout", "stderr"):
        if size := result.get(f"{stream}_bytes"):
            STREAM_BYTES.labels(stream).inc(size)


def sandbox_started(how: str) -> None:
    SANDBOX_STARTS.labels(how).inc()


def sandbox_failed() -> None:
    SANDBOX_FAILURES.inc()


def start_exporter(settings: Settings) -> ThreadingHTTPServer | None:
    """Serve this worker's metrics (every pool process's) on the configured port, in a thread."""
    if not settings.worker_metrics_port:
        return None
    if settings.metrics_dir is None:
        log.warning("PROMETHEUS_MULTIPROC_DIR is not set: the worker's metrics leave out its pool processes")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body, content_type = metrics.exposition(settings.metrics_dir)
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
            return

    try:
        server = ThreadingHTTPServer((settings.worker_metrics_host, settings.worker_metrics_port), Handler)
    except OSError as exc:
        log.error("worker metrics cannot listen on %s:%d: %s", settings.worker_metrics_host,
                  settings.worker_metrics_port, exc.strerror)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="runwarden-metrics", daemon=True).start()
    log.info("worker metrics on http://%s:%d/metrics", settings.worker_metrics_host, settings.worker_metrics_port)
    return server
