"""`python -m bench [--quick] [--soak-calls N] [--profile] [--out DIR]`: the whole benchmark, in one run.

Order of the run: start the stack → warm up → latency rounds (floors and runwarden interleaved, so a
noisy neighbour hits both alike) → throughput with 32 outstanding (floor and runwarden alternated) →
relay (pub/sub floor and runwarden alternated; then 20 concurrent streams) → worker memory soak →
API memory with 100 idle streams (last, because it can exhaust the API's Redis connections) → report.
Everything started is stopped in a `finally`, also on Ctrl-C and SIGTERM.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import websocket

from bench import cpu, floor_sandbox, profile, report, stack as stack_mod
from bench.client import Agent, BenchError, Http, read_stream
from bench.stats import slope, summary
from workers import workspace
from shared import keys

MIB = 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "results"
READ_PATH = "bench/read.txt"
PATCH_PATH = "bench/patch.txt"
REPLACE_NAME = "floor-replace.txt"  # beside PATCH_PATH: the durable write alone, measured where patches write
ZERO_SHA = "0" * 40


@dataclass(frozen=True)
class Mode:
    name: str
    rounds: int
    per_round: dict[str, int]
    warmup: int
    throughput_slices: int      # alternations of (bare spawn ×2, floor task, runwarden) in the throughput phase
    throughput_slice_s: float
    relay_reps: int
    relay_bytes: int
    multi_streams: int
    multi_bytes: int
    idle_streams: int
    soak_s: float
    soak_max_calls: int


# Samples per latency round. The WebSocket series are few: each is expensive on this stack.
PER_ROUND_FULL = {
    "floor.celery_bare": 100, "floor.bwrap_bare": 60, "floor.subprocess_true": 20,
    "part.celery_product": 60, "part.bwrap_product": 30, "part.bwrap_product_cgroup": 20,
    "part.prepared_handover": 30,
    "part.atomic_replace": 30, "rw.read_file": 60, "rw.apply_file_patch": 100, "rw.idempotent_replay": 40,
    "rw.shell_next": 60, "rw.shell_first": 40, "rw.shell_true_ws": 10, "rw.echo_first_output": 10,
}
PER_ROUND_QUICK = {
    "floor.celery_bare": 30, "floor.bwrap_bare": 20, "floor.subprocess_true": 6,
    "part.celery_product": 20, "part.bwrap_product": 10, "part.bwrap_product_cgroup": 6,
    "part.prepared_handover": 10,
    "part.atomic_replace": 10, "rw.read_file": 20, "rw.apply_file_patch": 30, "rw.idempotent_replay": 15,
    "rw.shell_next": 20, "rw.shell_first": 15, "rw.shell_true_ws": 4, "rw.echo_first_output": 4,
}
FULL = Mode("full", rounds=4, per_round=PER_ROUND_FULL, warmup=20, throughput_slices=2, throughput_slice_s=5.0,
            relay_reps=3, relay_bytes=48 * MIB, multi_streams=20, multi_bytes=8 * MIB, idle_streams=100,
            soak_s=300.0, soak_max_calls=10_000)  # the 10,000 calls; ~2 min here
QUICK = Mode("quick", rounds=1, per_round=PER_ROUND_QUICK, warmup=4, throughput_slices=1, throughput_slice_s=3.0,
             relay_reps=1, relay_bytes=48 * MIB, multi_streams=20, multi_bytes=1 * MIB, idle_streams=100,
             soak_s=6.0, soak_max_calls=10_000)
# An agent thinks between two calls of its run (seconds, for a model); the next-call series waits at
# least this long after the run's last call ended (untimed), so a prepared sandbox has had its time.
THINK_S = 0.2

LABELS = {
    "floor.celery_bare": "bare Celery no-op: Flask (gunicorn gthread) → send_task, Celery defaults → prefork -c 2 → result",
    "floor.bwrap_bare": "bare `bwrap --unshare-all … /usr/bin/true` (/usr, /proc, /dev, /tmp), subprocess.run",
    "floor.subprocess_true": "`subprocess.run([\"true\"])`",
    "part.celery_product": "runwarden's Celery: `runwarden.ping` via gunicorn with its worker class and configuration",
    "part.bwrap_product": "runwarden's sandbox: BwrapRunner spawning `true` (argv, uid drop, limits, /etc, workspace)",
    "part.bwrap_product_cgroup": "runwarden's cold spawn path: the same in its per-call cgroup",
    "part.prepared_handover": "a prepared sandbox: claimed from the keeper, `true` written, read to its exit, let go",
    "part.atomic_replace": "a patch's durable write alone: temp file, fsync, rename (30 bytes, beside the patched file)",
    "rw.read_file": "read_file, POST → 200",
    "rw.apply_file_patch": "apply_file_patch, POST → 200",
    "rw.idempotent_replay": "idempotent replay (same key again) → 200",
    "rw.shell_next": f"a run's next shell call: `true`, `Prefer: wait` → 200 (≥ {THINK_S:g} s after its last)",
    "rw.shell_first": "a new run's first shell call: `true`, `Prefer: wait` → 200",
    "rw.shell_true_ws": "shell `true`, POST → 202 + WebSocket to exit event",
    "rw.echo_first_output": "shell `echo hi`, POST sent → first output event",
}
SHELL_BIG = "head -c {n} /dev/zero | tr '\\0' x"  # printable bytes: JSON carries them 1:1 (NULs would be \\u0000)


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def creation_diff(path: str, data: bytes) -> str:
    lines = data.decode().split("\n")[:-1]
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines)


def patch_content(n: int) -> bytes:
    return f"header\nvalue {n}\nfooter\n".encode()


def patch_diff(n: int) -> str:
    return (f"--- a/{PATCH_PATH}\n+++ b/{PATCH_PATH}\n@@ -1,3 +1,3 @@\n header\n-value {n}\n+value {n + 1}\n"
            " footer\n")


class Bench:
    def __init__(self, bench: stack_mod.BenchStack, mode: Mode, out: Path, profiling: bool) -> None:
        self.s = bench
        self.mode = mode
        self.out = out
        self.profiling = profiling
        self.agent = Agent(bench.api_url, bench.secret)
        self.next_agent = Agent(bench.api_url, bench.secret, tenant=self.agent.tenant)  # its run: the next-call series
        self.next_at = 0.0  # when the next-call series may send again (its run's last call ended + THINK_S)
        self.api = Http(bench.api_url)
        self.floor = Http(bench.floor_url)
        self.bare = Http(bench.bare_url)
        self.sandbox = floor_sandbox.build(bench.settings, bench.root / "floor")
        # A keeper of the bench's own, for the hand-over part; stopped with the stack.
        bench.stack.children.append(("bench-keeper", floor_sandbox.start_keeper(self.sandbox, bench.env,
                                                                                bench.root / "floor")))
        self.spare = workspace.SpareFile(bench.settings.workspaces)
        self.samples: dict[str, list[float]] = {name: [] for name in LABELS}
        self.errors: dict[str, dict[str, Any]] = {}
        self.results: dict[str, Any] = {"throughput": {}, "relay": {}, "memory": {}}
        self.patch_n = 0
        self.read_sha = ""
        self.replay: tuple[bytes, dict[str, str], bytes] | None = None
        self.calls = 0  # calls the product worker ran, for the worker-memory report
        self.calls_lock = threading.Lock()

    # --- single operations: each returns its latency in seconds, or raises BenchError -----------------

    def count(self, n: int = 1) -> None:
        with self.calls_lock:
            self.calls += n

    def op_ping_http(self) -> float:
        t0 = time.perf_counter()
        status, _, data = self.floor.request("POST", "/ping", b"{}", {"Content-Type": "application/json"})
        elapsed = time.perf_counter() - t0
        if status != 200 or b"pong" not in data:
            raise BenchError(f"floor /ping: {status} {data[:200]!r}")
        self.count()
        return elapsed

    def op_bare_noop(self) -> float:
        t0 = time.perf_counter()
        status, _, data = self.bare.request("POST", "/noop", b"{}", {"Content-Type": "application/json"})
        elapsed = time.perf_counter() - t0
        if status != 200 or b"pong" not in data:
            raise BenchError(f"bare /noop: {status} {data[:200]!r}")
        return elapsed

    @staticmethod
    def _timed_exit(spawn: Callable[[], int], what: str) -> float:
        """Seconds one spawn-and-wait took; a non-zero exit is an error, not a sample."""
        t0 = time.perf_counter()
        code = spawn()
        elapsed = time.perf_counter() - t0
        if code != 0:
            raise BenchError(f"{what} exited {code}")
        return elapsed

    def op_subprocess(self) -> float:
        return self._timed_exit(floor_sandbox.bare_true, "true")

    def op_bwrap_bare(self) -> float:
        return self._timed_exit(lambda: floor_sandbox.bare_bwrap_true(self.sandbox.bare.bwrap), "bare bwrap true")

    def op_bwrap(self) -> float:
        return self._timed_exit(lambda: floor_sandbox.spawn_true(self.sandbox), "bwrap true")

    def op_handover(self) -> float:
        return floor_sandbox.handover_true(self.sandbox)

    def op_bwrap_cgroup(self) -> float:
        return self._timed_exit(lambda: floor_sandbox.spawn_true(self.sandbox, cgroup=True), "bwrap true (cgroup)")

    def op_replace(self) -> float:
        """workspace.replace, as the patch applier calls it (a spare file made ahead), in the
        directory the patches go to: creating a file there costs from 0.03 to over 1 ms depending
        on where the directory sits on an ext4 disk, so another directory would not be like for like."""
        workspaces = Path(self.s.env["RUNWARDEN_WORKSPACES"])
        directory = workspaces / self.agent.tenant / self.agent.run_id / os.path.dirname(PATCH_PATH)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        replaced: list[int] = []
        try:
            current = workspace.read(fd, REPLACE_NAME, keep_open=replaced)
            self.spare.restock()  # as a pool process does after each patch, off the clock
            t0 = time.perf_counter()
            workspace.replace(fd, REPLACE_NAME, patch_content(self.calls), current, spare=self.spare)
            return time.perf_counter() - t0
        finally:
            for held in [fd, *replaced]:  # the old file is let go after the answer, as PatchApplier does
                os.close(held)

    def op_read(self, http: Http | None = None) -> float:
        body, headers = self.agent.request("read_file", {"path": READ_PATH})
        t0 = time.perf_counter()
        answer = self.agent.send(http or self.api, body, headers, expect=200)
        elapsed = time.perf_counter() - t0
        self.count()
        if answer["result"]["sha"] != self.read_sha:
            raise BenchError("read_file returned another sha")
        return elapsed

    def op_patch(self) -> float:
        n = self.patch_n
        body, headers = self.agent.request("apply_file_patch", {"path": PATCH_PATH, "diff": patch_diff(n),
                                                                "base_sha": blob_sha(patch_content(n))})
        t0 = time.perf_counter()
        answer = self.agent.send(self.api, body, headers, expect=200)
        elapsed = time.perf_counter() - t0
        self.count()
        if answer["result"]["new_sha"] != blob_sha(patch_content(n + 1)):
            raise BenchError("apply_file_patch returned another new_sha")
        self.patch_n = n + 1
        return elapsed

    def op_replay(self) -> float:
        assert self.replay is not None
        body, headers, first = self.replay
        t0 = time.perf_counter()
        status, response_headers, data = self.api.request("POST", "/v1/tool-calls", body, headers)
        elapsed = time.perf_counter() - t0
        if status != 200 or response_headers.get("Idempotent-Replayed") != "true" or data != first:
            raise BenchError(f"replay: {status} {dict(response_headers)} {data[:200]!r}")
        return elapsed

    def op_shell_wait(self, http: Http | None = None, agent: Agent | None = None) -> float:
        body, headers = (agent or self.agent).request("execute_shell_command", {"command": "true"}, prefer_wait=30)
        t0 = time.perf_counter()
        answer = self.agent.send(http or self.api, body, headers, expect=200)
        elapsed = time.perf_counter() - t0
        self.count()
        if answer["status"] != "completed" or answer["result"]["exit_code"] != 0:
            raise BenchError(f"shell true: {answer['status']} {answer['result']}")
        return elapsed

    def op_shell_next(self) -> float:
        """A call of a run that made one before, at least THINK_S ago (the wait is not timed)."""
        time.sleep(max(0.0, self.next_at - time.monotonic()))
        try:
            return self.op_shell_wait(agent=self.next_agent)
        finally:
            self.next_at = time.monotonic() + THINK_S

    def op_shell_first(self) -> float:
        """The first call of a run never seen before (its workspace is made by this call)."""
        return self.op_shell_wait(agent=Agent(self.s.api_url, self.s.secret, tenant=self.agent.tenant))

    def shell_streamed(self, command: str) -> tuple[float, dict[str, Any], Any]:
        """POST a shell call (202), read its WebSocket to the end: (POST time, answer, stream)."""
        body, headers = self.agent.request("execute_shell_command", {"command": command})
        t0 = time.perf_counter()
        answer = self.agent.send(self.api, body, headers, expect=202)
        ws = self.agent.stream(answer["stream_url"])
        try:
            got = read_stream(ws)
        finally:
            ws.close()
        self.count()
        return t0, answer, got

    def op_shell_ws(self) -> float:
        t0, _, got = self.shell_streamed("true")
        if got.exit is None or got.exit_at is None or got.exit["exit_code"] != 0 or got.close_code != 1000:
            raise BenchError(f"shell true stream: {got}")
        return got.exit_at - t0

    def op_echo_first(self) -> float:
        body, headers = self.agent.request("execute_shell_command", {"command": "echo hi"})
        t0 = time.perf_counter()
        answer = self.agent.send(self.api, body, headers, expect=202)
        ws = self.agent.stream(answer["stream_url"])
        try:
            first = read_stream(ws, until_first_output=True)
            rest = read_stream(ws)  # untimed: let the call end before the next one starts
        finally:
            ws.close()
        self.count()
        if first.first_output_at is None or first.stdout_bytes != 3 or rest.exit is None:
            raise BenchError(f"echo hi stream: {first} {rest}")
        return first.first_output_at - t0

    OPS: dict[str, str] = {
        "floor.celery_bare": "op_bare_noop", "floor.bwrap_bare": "op_bwrap_bare", "floor.subprocess_true": "op_subprocess",
        "part.celery_product": "op_ping_http", "part.bwrap_product": "op_bwrap",
        "part.bwrap_product_cgroup": "op_bwrap_cgroup", "part.prepared_handover": "op_handover",
        "part.atomic_replace": "op_replace", "rw.read_file": "op_read",
        "rw.apply_file_patch": "op_patch", "rw.idempotent_replay": "op_replay", "rw.shell_next": "op_shell_next",
        "rw.shell_first": "op_shell_first", "rw.shell_true_ws": "op_shell_ws", "rw.echo_first_output": "op_echo_first",
    }

    def note_error(self, name: str, exc: Exception) -> None:
        record = self.errors.setdefault(name, {"count": 0, "examples": []})
        record["count"] += 1
        if len(record["examples"]) < 3:
            record["examples"].append(f"{type(exc).__name__}: {exc}"[:300])
        if record["count"] == 1:
            log(f"  ! {name}: {record['examples'][0]}")

    # --- phases ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        read_data = b"".join(b"%02d " % i + b"r" * 60 + b"\n" for i in range(16))  # 1 KiB
        self.agent.post(self.api, "apply_file_patch", {"path": READ_PATH, "diff": creation_diff(READ_PATH, read_data),
                                                       "base_sha": ZERO_SHA}, expect=200)
        self.agent.post(self.api, "apply_file_patch", {"path": PATCH_PATH, "base_sha": ZERO_SHA,
                                                       "diff": creation_diff(PATCH_PATH, patch_content(0))}, expect=200)
        self.read_sha = blob_sha(read_data)
        body, headers = self.agent.request("read_file", {"path": READ_PATH})
        status, _, first = self.api.request("POST", "/v1/tool-calls", body, headers)
        assert status == 200, first
        self.replay = (body, headers, first)
        self.count(3)

    def warmup(self) -> None:
        for name, method in self.OPS.items():
            for _ in range(self.mode.warmup if "ws" not in name and "echo" not in name else 2):
                try:
                    getattr(self, method)()
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    self.note_error(f"warmup {name}", exc)
        for _ in range(self.mode.warmup // 2):
            self.bare.request("POST", "/sandbox", b"{}", {"Content-Type": "application/json"})

    def latency(self) -> None:
        """Rounds of every series, interleaved sample by sample (floors, parts and runwarden alike),
        so a noisy neighbour hits them alike; with --profile, the first round runs series by series."""
        for number in range(1, self.mode.rounds + 1):
            started = time.monotonic()
            if self.profiling and number == 1:
                self._profiled_round()
            else:
                for turn in range(max(self.mode.per_round.values())):
                    for name, method in self.OPS.items():
                        if turn < self.mode.per_round[name]:
                            self._sample(name, getattr(self, method))
            log(f"  round {number}/{self.mode.rounds} in {time.monotonic() - started:.1f} s")

    def _sample(self, name: str, op: Callable[[], float]) -> None:
        try:
            self.samples[name].append(op() * 1000)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            self.note_error(name, exc)

    def _profiled_round(self) -> None:
        for name, method in self.OPS.items():
            profiled = name.startswith("rw.") and "ws" not in name and "echo" not in name
            with profile.maybe(self, f"latency-{name[3:]}", enabled=profiled):
                for _ in range(self.mode.per_round[name]):
                    self._sample(name, getattr(self, method))

    def closed_loop(self, name: str, clients: int, seconds: float, make_op: Callable[[], Callable[[], Any]],
                    warm_s: float = 0.5) -> dict[str, Any]:
        """`clients` threads, each with its own connection, each with one call outstanding at a time."""
        stop = threading.Event()
        done: list[tuple[float, float]] = []
        failures: list[str] = []
        lock = threading.Lock()
        ready = threading.Barrier(clients + 1)

        def client() -> None:
            op = make_op()
            ready.wait()
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    op()
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    with lock:
                        failures.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                t1 = time.perf_counter()
                with lock:
                    done.append((t1, t1 - t0))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        ready.wait()
        begin = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        end = time.perf_counter()
        for thread in threads:
            thread.join(120)
        window = [(t, lat) for t, lat in done if begin + warm_s <= t <= end]
        if failures:
            log(f"  ! {name}: {len(failures)} failed, e.g. {failures[0]}")
        return {"completed": len(window), "all_completed": len(done), "window_s": end - begin - warm_s,
                "per_s": len(window) / (end - begin - warm_s), "failures": len(failures),
                "failure_examples": failures[:3], "latency_ms": [lat * 1000 for _, lat in window]}

    def throughput(self) -> None:
        seconds = self.mode.throughput_slice_s
        slices: dict[str, list[dict[str, Any]]] = {"floor.bare_bwrap_x2": [], "floor.bare_task_x32": [],
                                                   "rw.shell_true_x32": []}

        def bare() -> Callable[[], Any]:
            return lambda: floor_sandbox.bare_bwrap_true(self.sandbox.bare.bwrap)

        def bare_task() -> Callable[[], Any]:
            http = Http(self.s.bare_url)

            def op() -> None:
                status, _, data = http.request("POST", "/sandbox", b"{}", {"Content-Type": "application/json"})
                if status != 200 or data != b'{"exit_code":0}':
                    raise BenchError(f"bare /sandbox: {status} {data[:200]!r}")
            return op

        def shell() -> Callable[[], Any]:
            http = Http(self.s.api_url)
            return lambda: self.op_shell_wait(http)

        roots = cpu.roots(self.s.stack.children)

        def metered(name: str, make_op: Callable[[], Callable[[], Any]]) -> dict[str, Any]:
            before = cpu.Snapshot(roots)
            outcome = self.closed_loop(name, 32, seconds, make_op)
            outcome["cpu_ms_per_call"] = cpu.per_call(before, cpu.Snapshot(roots), outcome["all_completed"])
            return outcome

        for number in range(self.mode.throughput_slices):
            slices["floor.bare_bwrap_x2"].append(self.closed_loop("bare bwrap ×2", 2, seconds, bare))
            slices["floor.bare_task_x32"].append(metered("bare task ×32", bare_task))
            with profile.maybe(self, "shell-throughput", enabled=self.profiling and number == 0):
                slices["rw.shell_true_x32"].append(metered("shell true ×32", shell))
            log("  slice {}: bare ×2 {:.0f}/s, bare task ×32 {:.0f}/s, runwarden shell ×32 {:.0f}/s".format(
                number + 1, *(slices[k][-1]["per_s"] for k in slices)))
        labels = {"floor.bare_bwrap_x2": "bare `bwrap … true`, 2 in parallel in the bench process",
                  "floor.bare_task_x32": "bare Celery task that only spawns the bare sandbox, via gunicorn gthread, "
                                         "32 outstanding",
                  "rw.shell_true_x32": "runwarden shell `true` (`Prefer: wait`, one run), 32 outstanding"}
        for name, runs in slices.items():
            completed = sum(r["completed"] for r in runs)
            window = sum(r["window_s"] for r in runs)
            latencies = [lat for r in runs for lat in r["latency_ms"]]
            self.results["throughput"][name] = {
                "label": labels[name], "per_s": completed / window, "completed": completed, "window_s": window,
                "slices_per_s": [r["per_s"] for r in runs], "failures": sum(r["failures"] for r in runs),
                "failure_examples": [e for r in runs for e in r["failure_examples"]][:3],
                "latency": summary(latencies),
            }
            if all("cpu_ms_per_call" in r for r in runs):
                self.results["throughput"][name]["cpu_ms_per_call"] = _weighted(
                    [(r["cpu_ms_per_call"], r["all_completed"]) for r in runs])

    def relay_floor_once(self, total: int) -> dict[str, Any]:
        name = uuid.uuid4().hex[:10]
        floor_ws = self.s.floor_url.replace("http://", "ws://", 1)
        ws = websocket.create_connection(f"{floor_ws}/pubsub/{name}", timeout=120, skip_utf8_validation=True,
                                         suppress_origin=True)
        try:
            opcode, data = ws.recv_data()
            assert data == b"ready", data
            publisher = subprocess.Popen([sys.executable, "-m", "bench.publisher", self.s.redis_url, name, str(total),
                                          str(64 * 1024)], env=self.s.env)
            sha, received, first_at, first_len, last_at = hashlib.sha256(), 0, 0.0, 0, 0.0
            while True:
                opcode, data = ws.recv_data(control_frame=True)
                if opcode == websocket.ABNF.OPCODE_CLOSE:
                    break
                if opcode != websocket.ABNF.OPCODE_TEXT:
                    continue
                last_at = time.perf_counter()
                if not received:
                    first_at, first_len = last_at, len(data)
                received += len(data)
                sha.update(data)
            publisher.wait(60)
        finally:
            ws.close()
        if received != total or sha.hexdigest() != hashlib.sha256(b"x" * total).hexdigest():
            raise BenchError(f"pub/sub floor received {received} of {total} bytes")
        return {"bytes": received, "mb_per_s": (received - first_len) / (last_at - first_at) / 1e6}

    def relay_rw_once(self, total: int) -> dict[str, Any]:
        t0, answer, got = self.shell_streamed(SHELL_BIG.format(n=total))
        self.s.redis.delete(keys.log(answer["task_id"]))  # free Redis memory: the log is no longer needed
        if not (got.sha_ok and got.seq_ok and got.stdout_bytes == total and got.close_code == 1000
                and got.exit and got.exit["exit_code"] == 0 and not got.exit["truncated"]):
            raise BenchError(f"relay stream lost or changed bytes: {got}")
        assert got.first_output_at is not None and got.last_output_at is not None and got.exit_at is not None
        return {"bytes": total, "events": got.events,
                "mb_per_s": (total - got.first_output_bytes) / (got.last_output_at - got.first_output_at) / 1e6,
                "end_to_end_mb_per_s": total / (got.exit_at - t0) / 1e6,
                "first_output_at": got.first_output_at, "last_output_at": got.last_output_at, "t0": t0,
                "exit_at": got.exit_at}

    def relay(self) -> None:
        floor_runs, rw_runs = [], []
        for number in range(self.mode.relay_reps):
            floor_runs.append(self.relay_floor_once(self.mode.relay_bytes))
            with profile.maybe(self, "relay", enabled=self.profiling and number == 0):
                rw_runs.append(self.relay_rw_once(self.mode.relay_bytes))
            log(f"  rep {number + 1}: pub/sub floor {floor_runs[-1]['mb_per_s']:.0f} MB/s, "
                f"runwarden {rw_runs[-1]['mb_per_s']:.0f} MB/s")
        median = lambda runs, key: sorted(r[key] for r in runs)[len(runs) // 2]  # noqa: E731
        self.results["relay"]["floor.pubsub_ws"] = {
            "label": f"Redis pub/sub → flask-sock → WebSocket, 64 KiB messages, {self.mode.relay_bytes // MIB} MiB",
            "mb_per_s": median(floor_runs, "mb_per_s"), "runs_mb_per_s": [r["mb_per_s"] for r in floor_runs]}
        self.results["relay"]["rw.single_stream"] = {
            "label": f"runwarden, one stream of {self.mode.relay_bytes // MIB} MiB (first → last output event)",
            "mb_per_s": median(rw_runs, "mb_per_s"), "runs_mb_per_s": [r["mb_per_s"] for r in rw_runs],
            "end_to_end_mb_per_s": median(rw_runs, "end_to_end_mb_per_s"), "events": rw_runs[0]["events"]}
        self.multi_stream()

    def multi_stream(self) -> None:
        n, size = self.mode.multi_streams, self.mode.multi_bytes
        outcomes: list[Any] = [None] * n
        posted = []
        t0 = time.perf_counter()
        for _ in range(n):
            body, headers = self.agent.request("execute_shell_command", {"command": SHELL_BIG.format(n=size)})
            posted.append(self.agent.send(self.api, body, headers, expect=202))

        def follow(index: int) -> None:
            try:
                ws = self.agent.stream(posted[index]["stream_url"], timeout=300)
                try:
                    outcomes[index] = read_stream(ws)
                finally:
                    ws.close()
            except Exception as exc:  # noqa: BLE001
                outcomes[index] = exc

        threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        self.count(n)
        for answer in posted:
            self.s.redis.delete(keys.log(answer["task_id"]))
        good = [o for o in outcomes if not isinstance(o, Exception) and o is not None and o.sha_ok and o.seq_ok
                and o.stdout_bytes == size and o.close_code == 1000]
        bad = [repr(o)[:300] for o in outcomes if o not in good]
        total = sum(o.stdout_bytes for o in good)
        first = min((o.first_output_at for o in good), default=0.0)
        last = max((o.last_output_at for o in good), default=0.0)
        end = max((o.exit_at for o in good), default=0.0)
        self.results["relay"]["rw.multi_stream"] = {
            "label": f"runwarden, {n} concurrent streams of {size // MIB} MiB (aggregate, first → last output)",
            "streams": n, "verified": len(good), "lost": n - len(good), "bad_examples": bad[:3],
            "mb_per_s": total / (last - first) / 1e6 if good else 0.0,
            "end_to_end_mb_per_s": total / (end - t0) / 1e6 if good else 0.0,
        }
        log(f"  {n} streams: {len(good)}/{n} verified, aggregate "
            f"{self.results['relay']['rw.multi_stream']['mb_per_s']:.0f} MB/s")

    def idle_streams(self) -> None:
        """API RSS before/with N idle open streams (calls to `sleep 60`: 2 run, the rest wait in the queue),
        whether the API still answers meanwhile, then cancel them all (retrying 503s) and close."""
        pid = stack_mod.api_worker_pid(self.s)
        time.sleep(1)
        before, threads_before = stack_mod.rss_kib(pid), stack_mod.status_field(pid, "Threads")
        opened: list[tuple[str, websocket.WebSocket]] = []
        open_failures: list[str] = []
        probes: dict[str, int] = {}
        during = threads_during = 0
        try:
            for _ in range(self.mode.idle_streams):
                try:
                    answer = self.agent.post(self.api, "execute_shell_command", {"command": "sleep 60"}, expect=202)
                    opened.append((answer["task_id"], self.agent.stream(answer["stream_url"], timeout=60)))
                except Exception as exc:  # noqa: BLE001 - reported
                    open_failures.append(f"{type(exc).__name__}: {exc}"[:200])
            self.count(len(opened))
            time.sleep(2)
            during, threads_during = stack_mod.rss_kib(pid), stack_mod.status_field(pid, "Threads")
            # Does the API still serve other clients while the streams are open? An idempotent replay
            # needs only the API and Redis (no worker), so it isolates the API's own capacity.
            assert self.replay is not None
            body, headers, _ = self.replay
            probe = Http(self.s.api_url, timeout=10)
            for _ in range(10):
                try:
                    status, _, _ = probe.request("POST", "/v1/tool-calls", body, headers)
                except OSError as exc:
                    status = type(exc).__name__
                probes[str(status)] = probes.get(str(status), 0) + 1
            probe.close()
        finally:
            # Close the clients first: a server-side close is followed by gunicorn's 2 s linger for the
            # peer's FIN on its event-loop thread, which would serialise the teardown.
            for _, ws in opened:
                try:
                    ws.close(timeout=0.2)
                except Exception:  # noqa: BLE001
                    pass
            teardown = self.cancel_all([task_id for task_id, _ in opened])
        time.sleep(1)
        after = stack_mod.rss_kib(pid)
        n = max(1, len(opened))
        self.results["memory"]["api_idle_streams"] = {
            "streams": len(opened), "open_failures": len(open_failures), "open_failure_examples": open_failures[:3],
            "rss_before_kib": before, "rss_with_streams_kib": during, "rss_after_close_kib": after,
            "threads_before": threads_before, "threads_with_streams": threads_during,
            "per_stream_kib": (during - before) / n, "probe_statuses": probes, **teardown,
        }
        log(f"  API RSS {before / 1024:.1f} → {during / 1024:.1f} MiB with {len(opened)} idle streams "
            f"({(during - before) / n:.0f} KiB each); threads {threads_before} → {threads_during}; "
            f"replays meanwhile: {probes}; cancels {teardown}")

    def cancel_all(self, task_ids: list[str], budget_s: float = 45.0, clients: int = 8) -> dict[str, Any]:
        """DELETE each call, retrying 503 (the API may be out of Redis connections) within a budget."""
        deadline = time.monotonic() + budget_s
        statuses: dict[str, int] = {}
        retries = [0]
        lock = threading.Lock()
        pending = list(task_ids)
        started = time.monotonic()

        def client() -> None:
            http = Http(self.s.api_url)
            while True:
                with lock:
                    if not pending:
                        return
                    task_id = pending.pop()
                status = 0
                while True:
                    try:
                        status = self.agent.delete(http, task_id)
                    except OSError:
                        status = -1
                    if status not in (503, -1) or time.monotonic() > deadline:
                        break
                    with lock:
                        retries[0] += 1
                    time.sleep(0.05)
                with lock:
                    statuses[str(status)] = statuses.get(str(status), 0) + 1

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(budget_s + 30)
        return {"cancel_statuses": statuses, "cancel_retries_503": retries[0],
                "cancel_s": round(time.monotonic() - started, 1)}

    def soak(self, start_rss: dict[str, int], start_calls: int) -> None:
        points: list[tuple[int, int]] = []
        budget = self.mode.soak_max_calls
        stop_at = time.monotonic() + self.mode.soak_s
        soak_start_calls = self.calls
        soak_start_rss = sum(stack_mod.worker_rss(self.s).values())
        stop = threading.Event()
        failures: list[str] = []

        def client(index: int) -> None:
            http, turn = Http(self.s.api_url), index
            while not stop.is_set() and self.calls - soak_start_calls < budget:
                turn += 1
                try:
                    (self.op_shell_wait if turn % 2 else self.op_read)(http)
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"{type(exc).__name__}: {exc}"[:300])

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(32)]
        soak_started = time.monotonic()
        for thread in threads:
            thread.start()
        while time.monotonic() < stop_at and self.calls - soak_start_calls < budget:
            time.sleep(1)
            points.append((self.calls - soak_start_calls, sum(stack_mod.worker_rss(self.s).values())))
        stop.set()
        for thread in threads:
            thread.join(120)
        soak_s = time.monotonic() - soak_started
        time.sleep(1)
        end = stack_mod.worker_rss(self.s)
        soak_calls = self.calls - soak_start_calls
        half = [p for p in points if p[0] >= soak_calls / 2]
        growth_per_k = slope(half) * 1000
        self.results["memory"]["worker"] = {
            "rss_start_kib": start_rss, "rss_end_kib": end,
            "rss_start_total_kib": sum(start_rss.values()), "rss_end_total_kib": sum(end.values()),
            "calls_since_start": self.calls - start_calls,
            "soak_calls": soak_calls, "soak_s": round(soak_s, 1), "soak_failures": len(failures),
            "soak_failure_examples": failures[:3],
            "soak_rss_start_total_kib": soak_start_rss, "soak_points": points,
            "growth_kib_per_1000_calls_second_half": growth_per_k,
            "pool_children_same": sorted(k for k in start_rss if k.startswith("child")) ==
            sorted(k for k in end if k.startswith("child")),
        }
        if failures:
            log(f"  ! soak: {len(failures)} failures, e.g. {failures[0]}")
        log(f"  soak: {soak_calls} calls in {soak_s:.0f} s; worker RSS "
            f"{sum(start_rss.values()) / 1024:.1f} MiB at start → {sum(end.values()) / 1024:.1f} MiB after "
            f"{self.calls - start_calls} calls; second-half slope {growth_per_k:+.1f} KiB/1000 calls")


def _weighted(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Per-call values of several slices, each weighted by the calls it completed."""
    calls = sum(n for _, n in parts) or 1
    roles = {role for values, _ in parts for role in values}
    return {role: round(sum(values.get(role, 0.0) * n for values, n in parts) / calls, 3) for role in sorted(roles)}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as info:
        mem_kib = int(info.readline().split()[1])
    from importlib.metadata import version
    versions = {name: version(name) for name in ("celery", "kombu", "redis", "flask", "flask-sock",
                                                  "simple-websocket", "gunicorn", "websocket-client")}
    from runwarden.devstack import find_redis_server
    from workers.sandbox import find_bwrap
    for name, argv in (("redis-server", [find_redis_server(), "--version"]), ("bwrap", [find_bwrap() or "bwrap", "--version"])):
        try:
            versions[name] = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            versions[name] = "unknown"
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "mem_total_gib": round(mem_kib / 1024 / 1024, 1),
            "kernel": platform.release(), "python": platform.python_version(), "versions": versions,
            "loadavg_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about one minute instead of about four")
    parser.add_argument("--profile", action="store_true",
                        help="also record py-spy profiles (on-CPU, collapsed stacks in the output directory) of "
                             "the API worker and the Celery pool during the first latency round of each runwarden "
                             "HTTP series, the shell-throughput phase and the relay (perturbs those numbers)")
    parser.add_argument("--soak-calls", type=int, metavar="N",
                        help="run the worker-memory soak until N calls instead of for a fixed time "
                             "(e.g. 10000; about 4 minutes more on 2 cores)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where latest.json/latest.png go (default bench/results)")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    if args.soak_calls:
        mode = dataclasses.replace(mode, soak_s=3600.0, soak_max_calls=args.soak_calls)
    args.out.mkdir(parents=True, exist_ok=True)

    def terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)

    started = time.monotonic()
    info = machine()
    log(f"runwarden bench ({mode.name}): starting the stack on loopback …")
    # One tenant makes every call: its `max_running` (64 by default) would refuse idle streams past it.
    bench_stack = stack_mod.start(args.out / "logs", RUNWARDEN_TENANT_MAX_RUNNING="100000")
    try:
        bench = Bench(bench_stack, mode, args.out, args.profile)
        log(f"  API {bench_stack.api_url}, floor {bench_stack.floor_url} ({time.monotonic() - started:.1f} s)")
        bench.setup()
        log("warm-up …")
        bench.warmup()
        start_rss, start_calls = stack_mod.worker_rss(bench_stack), bench.calls
        phases = (("latency rounds (floors and runwarden interleaved)", bench.latency),
                  ("throughput, 32 outstanding", bench.throughput),
                  ("relay", bench.relay),
                  ("worker memory soak", lambda: bench.soak(start_rss, start_calls)),
                  (f"API memory, {mode.idle_streams} idle streams (last: it can leave the API short of "
                   "Redis connections)", bench.idle_streams))
        for title, phase in phases:
            log(f"{title} …")
            t = time.monotonic()
            phase()
            log(f"  ({time.monotonic() - t:.1f} s)")
            if death := bench_stack.stack.died():
                raise RuntimeError(f"a stack process died: {death}")
        info["loadavg_end"] = os.getloadavg()
        results = report.assemble(bench, mode, info, time.monotonic() - started, LABELS)
    finally:
        log("stopping the stack …")
        bench_stack.stop()
    table = report.markdown(results)
    print(table)
    (args.out / "latest.json").write_text(json.dumps(results, indent=1))
    (args.out / "latest.md").write_text(table + "\n")
    report.chart(results, args.out / "latest.png")
    log(f"wrote {args.out / 'latest.json'}, {args.out / 'latest.png'} ({time.monotonic() - started:.0f} s in all)")
    return 0
