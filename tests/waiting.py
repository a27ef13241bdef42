"""Waiting for a condition, with a generous bound: tests never sleep-then-assert, never time a thing."""
from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")
ACTIVE = ("queued", "running")


def wait_until(check: Callable[[], T], timeout_s: float, what: str, interval: float = 0.02) -> T:
    """The first truthy value of `check()`; an AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval)


def status_of(agent: Any, task_id: str) -> str | None:
    response = agent.get(task_id)
    return response.json()["status"] if response.status_code == 200 else None


def ended(agent: Any, task_id: str, timeout_s: float = 60) -> dict[str, Any]:
    """The call's GET body once it is no longer queued or running."""
    def body() -> dict[str, Any] | None:
        found = agent.get(task_id).json()
        return found if found.get("status") not in ACTIVE else None
    return wait_until(body, timeout_s, f"{task_id} to end", 0.05)


def cancel(agent: Any, task_id: str) -> None:
    response = agent.http.delete(f"{agent.stack.base_url}/v1/tool-calls/{task_id}",
                                 headers={"Authorization": f"Bearer {agent.token}"}, timeout=30)
    assert response.status_code in (200, 202), response.text


def run(agent, command: str, **parameters) -> dict:  # type: ignore[no-untyped-def]
    """A shell call that must complete (whatever its exit code): its result."""
    response = agent.shell(command, wait=30, **parameters)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "completed", body
    return body["result"]
