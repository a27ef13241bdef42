"""When to try a call again, and how long to wait first.

A retry resends the very same request (same Idempotency-Key, same call_id, same body), so the
server runs it at most once and answers every later try with the first outcome. What is worth
another try: no answer at all, a 5xx (never kept by the server, so the key stays free), a 429
(`rate_limited`, `quota_exceeded`: nothing was enqueued) and a 409 `idempotency_key_in_use` (the
first try is still running). Waits honour `Retry-After` and otherwise back off exponentially with
jitter, so clients that failed together do not come back together.

urllib3's `Retry` is not used: it cannot tell a 409 in use from another 409, has no bound on the
total time, and the same policy also governs the WebSocket's reconnects.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from runwarden_client.errors import RunwardenError


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # tries after the first that failed (waits for a running first try do not count)
    deadline_s: float = 60.0  # all the waiting one call may do
    base_s: float = 0.25
    cap_s: float = 8.0

    def backoff(self, failures: int) -> float:
        """"Equal jitter": half the exponential step for sure, the other half at random."""
        step = min(self.cap_s, self.base_s * 2.0 ** max(0, failures - 1))
        return step / 2 + random.uniform(0, step / 2)


def retryable(status: int, code: str) -> bool:
    return status >= 500 or status == 429 or (status == 409 and code == "idempotency_key_in_use")


def retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (delay-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class Budget:
    """The retries left to one logical call (or to one outage of a stream)."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures = 0
        self.deadline = time.monotonic() + policy.deadline_s

    def wait(self, error: RunwardenError, after_s: float | None, *, failure: bool = True) -> None:
        """Sleep before the next try, or raise `error` when no try is left in time."""
        if failure:
            self.failures += 1
            if self.failures > self.policy.attempts:
                raise error
        delay = max(after_s or 0.0, self.policy.backoff(self.failures))
        if time.monotonic() + delay > self.deadline:
            raise error
        time.sleep(delay)
