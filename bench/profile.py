"""`--profile`: py-spy records of the API's gunicorn worker and the Celery worker (main + pool children)
during one phase, saved as collapsed stacks (bench/results/profile-*.txt, loadable in speedscope or
flamegraph.pl), with the top functions by on-CPU self and inclusive samples in latest.json."""
from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from bench import stack as stack_mod

_LINE = re.compile(r":\d+\)$")
_OWN = re.compile(r"\((api|workers|shared)/[^)]*\)$")


def py_spy() -> str | None:
    return shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                      if (Path(sys.executable).parent / "py-spy").exists() else None)


@contextmanager
def maybe(bench: Any, phase: str, *, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    binary = py_spy()
    if binary is None:
        print("  ! --profile: py-spy not found (pip install py-spy)", file=sys.stderr)
        yield
        return
    targets = {"api": (stack_mod.api_worker_pid(bench.s), []), "worker": (bench.s.worker.pid, ["--subprocesses"])}
    running = []
    for label, (pid, extra) in targets.items():
        out = bench.out / f"profile-{phase}-{label}.txt"
        argv = [binary, "record", "--pid", str(pid), "--format", "raw", "--output", str(out), "--rate", "200",
                "--nonblocking", *extra]
        running.append((label, out, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    try:
        yield
    finally:
        for _, _, process in running:
            process.send_signal(signal.SIGINT)
        for label, out, process in running:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
            if out.exists():
                bench.results.setdefault("profiles", {})[f"{phase}/{label}"] = {"file": out.name, **summarize(out)}


def summarize(path: Path, top: int = 15) -> dict[str, Any]:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_LINE.sub(")", frame) for frame in stack.split(";") if frame]
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    # Inclusive time is shown for runwarden's own functions (the trunk — thread bootstrap, gunicorn,
    # celery's worker loop — is on every stack and says nothing).
    branches = collections.Counter({f: n for f, n in inclusive.items() if _OWN.search(f)})
    share = lambda counter: [(frame, round(100 * n / total, 1)) for frame, n in counter.most_common(top)]  # noqa: E731
    return {"samples": total, "self_pct": share(own) if total else [],
            "inclusive_pct": share(branches) if total else []}
