"""Prometheus metrics (contract section 12): the families both sides count, and their exposition.

A family is exported by the side that measures it: the API's are in `api/metrics.py`, the workers'
in `workers/metrics.py`. A call's end is counted here, by `shared.records`, in whichever process
made the terminal transition (a worker's pool process, a worker's reaper, or the API cancelling a
queued call or finding a lost one), once: the Lua script that ends a call says whether it did.

Labels are bounded: tool names, outcomes, stream names, quota names. Never a tenant, run or task id:
each label value is a time series Prometheus keeps in memory, and tenants are unbounded; the audit
trail (`GET /v1/audit`, `runwarden audit`) answers per-tenant questions.

Under gunicorn and Celery's prefork pool every process counts in its own file in
PROMETHEUS_MULTIPROC_DIR (prometheus-client's multiprocess mode, chosen by that variable before the
first metric exists), and a scrape sums them all.
"""
from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess

from shared.schema import TOOLS

# Seconds; a shell call may take 60 s and wait in a queue behind others.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

CALLS = Counter("runwarden_tool_calls_total", "Tool calls ended, by tool and outcome (the call's final status)",
                ["tool", "outcome"])
CALL_DURATION = Histogram("runwarden_tool_call_duration_seconds",
                          "Seconds from a call's POST to its outcome", ["tool"], buckets=DURATION_BUCKETS)


def tool_label(tool: str) -> str:
    return tool if tool in TOOLS else "other"


def call_ended(tool: str, outcome: str, created_ms: int | None, ended_ms: int) -> None:
    """Count one call's end (its terminal transition, made by this process)."""
    CALLS.labels(tool_label(tool), outcome).inc()
    if created_ms is not None:
        CALL_DURATION.labels(tool_label(tool)).observe(max(0, ended_ms - created_ms) / 1000)


def exposition(metrics_dir: Path | None) -> tuple[bytes, str]:
    """This side's metrics as Prometheus text: every process's (summed) in multiprocess mode."""
    if metrics_dir is None:
        return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _pid_of(db_file: Path) -> int | None:
    """`counter_1234.db`, `gauge_livesum_1234.db` → 1234."""
    tail = db_file.stem.rpartition("_")[2]
    return int(tail) if tail.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def forget_dead_processes(metrics_dir: Path | None, *, counters_too: bool = False) -> None:
    """Drop what processes no longer running left: their live gauges (an open stream they counted
    is gone with them), and with `counters_too` everything (a worker starting anew)."""
    if metrics_dir is None:
        return
    for db_file in metrics_dir.glob("*.db"):
        pid = _pid_of(db_file)
        if pid is None or _alive(pid):
            continue
        if counters_too:
            db_file.unlink(missing_ok=True)
        else:
            multiprocess.mark_process_dead(pid, str(metrics_dir))
