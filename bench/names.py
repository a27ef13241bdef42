"""Names shared by the bench process, the floor app and the floor worker (importing this starts nothing)."""
FLOOR_QUEUE = "bench.floor"
SANDBOX_TASK = "bench.sandbox_true"
BARE_QUEUE = "celery"  # the bare floor's (bench/bare.py): Celery's default queue
BARE_NOOP_TASK = "bare.noop"
BARE_SANDBOX_TASK = "bare.sandbox_true"
END = b"END"


def channel(name: str) -> str:
    return f"bench:pubsub:{name}"
