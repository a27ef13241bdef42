"""A call given to its Celery queue whose message a crash lost (popped by the broker, never recorded
as unacked: a Redis SIGKILL at that moment) ends `lost` instead of holding its key (409) and its
tenant's slot for ever; a call whose message is still in its queue, or held unacked by a worker, or
that was given to the queue only just now, is left alone. On a real Redis, through the same claim
the API makes and the same script the worker's reaper runs."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from runwarden import devstack
from shared import keys
from shared.idempotency import Admitted, Idempotency
from shared.records import KOMBU_UNACKED, Records
from shared.scheduler import Scheduler
from shared.settings import Settings
from shared.tenants import Quotas


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    stack = devstack.Stack()
    url = devstack.start_redis(stack, Path(tmp_path_factory.mktemp("lost")))
    yield redis.Redis.from_url(url)
    stack.stop()


def now_ms() -> int:
    return int(time.time() * 1000)


def dispatched_call(client: redis.Redis, tool_name: str, queue: str) -> tuple[str, str, str]:
    """A call claimed and given to its queue (a worker's capacity free), as the API claims it."""
    Scheduler(client).heartbeat(queue, "w-test", 2, 60)
    settings = Settings.from_env({"RUNWARDEN_REDIS_URL": "redis://unused"}, require_jwt=False)
    tenant, key = f"t{uuid.uuid4().hex[:10]}", f"k-{uuid.uuid4()}"
    admitted = Idempotency(client, 3600, 1000, Quotas.defaults(settings)).claim(
        tenant=tenant, key=key, fp="fp", run_id="run", call_id=str(uuid.uuid4()), tool_name=tool_name,
        created_ms=now_ms(), queue=queue)
    assert isinstance(admitted, Admitted) and admitted.direct
    return tenant, key, keys.task_id_for(tenant, key)


def kombu_message(task_id: str) -> str:
    """What kombu stores for a Celery message: the task id is in its headers, in the clear."""
    return json.dumps({"body": "W1tdLCB7fV0=", "headers": {"id": task_id, "task": "t"}, "properties": {}})


@pytest.mark.parametrize(("tool_name", "queue"), [("execute_shell_command", keys.SHELL_QUEUE),
                                                  ("apply_file_patch", keys.FILE_QUEUE)])
def test_a_call_whose_message_is_nowhere_ends_lost_and_frees_its_key(client: redis.Redis, tool_name: str,
                                                                      queue: str) -> None:
    records = Records(client, ttl_s=3600, retention_s=3600, lease_s=10)
    tenant, key, task_id = dispatched_call(client, tool_name, queue)
    later = now_ms() + 1

    client.lpush(queue, kombu_message(task_id))  # still in its queue: a worker will take it
    assert not records.lose_unsent(task_id, later)
    client.delete(queue)
    client.hset(KOMBU_UNACKED, "tag-1", json.dumps([kombu_message(task_id), "", queue]))  # a worker has it
    assert not records.lose_unsent(task_id, later)
    client.hdel(KOMBU_UNACKED, "tag-1")
    assert not records.lose_unsent(task_id, now_ms() - 60_000)  # given to the queue only just now
    assert records.get(task_id).status.value == "queued"

    assert records.lose_unsent(task_id, later)  # nowhere: lost
    view = records.get(task_id)
    assert view.status.value == "lost" and view.result["code"] == "message_lost"
    assert client.hget(keys.idempotency(tenant, key), "state") == b"done"  # a retry replays, no 409
    assert not client.sismember(keys.tenant_active(tenant), task_id)  # the tenant's slot is back
    assert not client.sismember(keys.inflight(queue), task_id)  # and the queue's
    if tool_name == "execute_shell_command":
        assert view.result["termination"] == "lost"
        [(_, fields)] = client.xrange(keys.log(task_id))
        assert json.loads(fields[b"e"])["status"] == "lost"  # a stream ends with its exit event
    else:
        assert json.loads(client.hget(keys.idempotency(tenant, key), "body"))["status"] == "lost"
    assert not records.lose_unsent(task_id, later)  # once


def test_the_reaper_looks_only_at_calls_given_to_its_queues_long_enough_ago(client: redis.Redis) -> None:
    records = Records(client, ttl_s=3600, retention_s=3600, lease_s=10)
    _, _, task_id = dispatched_call(client, "execute_shell_command", keys.SHELL_QUEUE)
    assert records.lose_unsent_calls([keys.SHELL_QUEUE]) == 0  # dispatched just now
    client.hset(keys.task(task_id), "dispatched_ms", now_ms() - 31_000)
    assert records.lose_unsent_calls([keys.FILE_QUEUE]) == 0  # not that queue's
    assert records.lose_unsent_calls([keys.SHELL_QUEUE]) == 1
    assert records.get(task_id).status.value == "lost"
