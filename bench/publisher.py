"""`python -m bench.publisher REDIS_URL CHANNEL TOTAL_BYTES MESSAGE_BYTES`: the pub/sub floor's producer,
a separate process as the worker is. Publishes in small pipelines, then `END`."""
from __future__ import annotations

import sys

import redis

from bench.names import END, channel


def main() -> None:
    url, name, total, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = redis.Redis.from_url(url)
    payload = b"x" * size
    sent, batch = 0, 4
    while sent < total:
        pipe = client.pipeline(transaction=False)
        for _ in range(batch):
            if sent >= total:
                break
            piece = payload[: min(size, total - sent)]
            pipe.publish(channel(name), piece)
            sent += len(piece)
        pipe.execute()
    client.publish(channel(name), END)


if __name__ == "__main__":
    main()
