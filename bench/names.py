"""Names shared by the bench process, the floor app and the floor worker (importing this starts nothing)."""
FLOOR_QUEUE = "bench.floor"
SANDBOX_TASK = "bench.sandbox_true"
END = b"END"


def channel(name: str) -> str:
    return f"bench:pubsub:{name}"
