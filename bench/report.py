"""Results: the JSON document, the markdown table and the PNG chart."""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from bench import cpu
from bench.stats import summary

WORKER_GROWTH_LIMIT_KIB_PER_1000 = 50.0  # ≈ 50 bytes per call: anything that leaks per call shows above it


def assemble(bench: Any, mode: Any, info: dict[str, Any], duration_s: float, labels: dict[str, str]) -> dict[str, Any]:
    latency = {}
    for name, samples in bench.samples.items():
        latency[name] = {"label": labels[name], "kind": {"floor": "floor", "part": "part"}.get(name.split(".")[0], "runwarden"),
                         **summary(samples), "errors": bench.errors.get(name, {}).get("count", 0),
                         "samples_ms": [round(v, 4) for v in samples]}
    results = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode.name, "duration_s": round(duration_s, 1), "machine": info,
        "config": {k: v for k, v in vars(mode).items()},
        "latency": latency, "throughput": bench.results["throughput"], "relay": bench.results["relay"],
        "memory": bench.results["memory"], "errors": bench.errors,
        "profiles": bench.results.get("profiles", {}),
    }
    results["targets"] = targets(results)
    return results


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of issue 15, each against the bare floors of the same run, p50 and p99; then the
    parts that explain the gap (info), the relay and memory targets."""
    lat, thr, relay, mem = r["latency"], r["throughput"], r["relay"], r["memory"]
    celery, bwrap = lat["floor.celery_bare"], lat["floor.bwrap_bare"]
    rows: list[dict[str, Any]] = []

    def row(name: str, measured: float, floor: float, unit: str, goal: str, ratio: float, met: bool | None,
            floor_label: str) -> None:
        rows.append({"target": name, "measured": measured, "floor": floor, "unit": unit, "ratio": ratio,
                     "goal": goal, "met": met, "floor_label": floor_label})

    def latency_goal(name: str, series: str, floor: float, floor_label: str, at_most: float | None) -> None:
        s = lat[series]
        if not s.get("n"):
            return
        ratio = _ratio(s["p50"], floor)
        row(f"{name} p50", s["p50"], floor, "ms", f"≤ {at_most:g}" if at_most else "(info)", ratio,
            ratio <= at_most if at_most else None, floor_label)
        ratio = _ratio(s["p99"], floor)
        row(f"{name} p99", s["p99"], floor, "ms", "≤ 2" if at_most else "(info)", ratio,
            ratio <= 2.0 if at_most else None, floor_label)

    shell_floor, shell_label = celery["p50"] + bwrap["p50"], "bare Celery p50 + bare bwrap p50"
    latency_goal("a run's next shell call", "rw.shell_next", shell_floor, shell_label, 0.9)
    latency_goal("a new run's first shell call", "rw.shell_first", shell_floor, shell_label, 1.3)
    latency_goal("apply_file_patch", "rw.apply_file_patch", celery["p50"], "bare Celery p50", 1.25)
    latency_goal("read_file", "rw.read_file", celery["p50"], "bare Celery p50", None)
    latency_goal("shell `true` via WebSocket", "rw.shell_true_ws", shell_floor, shell_label, None)
    if thr:
        shell_tp, floor_tp = thr["rw.shell_true_x32"], thr["floor.bare_task_x32"]
        ratio = _ratio(shell_tp["per_s"], floor_tp["per_s"])
        row("shell throughput, 32 outstanding", shell_tp["per_s"], floor_tp["per_s"], "calls/s", "≥ 0.9", ratio,
            ratio >= 0.9, "bare Celery task that only spawns the bare sandbox")
        p99, floor_p50 = shell_tp["latency"].get("p99", 0.0), floor_tp["latency"].get("p50", 0.0)
        ratio = _ratio(p99, floor_p50)
        row("shell throughput, latency p99", p99, floor_p50, "ms", "≤ 2", ratio, ratio <= 2.0,
            "bare task's latency p50")
    for name, part, floor, floor_label in (
            ("part: runwarden's Celery configuration and server", "part.celery_product", celery, "bare Celery"),
            ("part: runwarden's sandbox argv, no cgroup", "part.bwrap_product", bwrap, "bare bwrap"),
            ("part: runwarden's cold spawn (in its cgroup)", "part.bwrap_product_cgroup", bwrap, "bare bwrap"),
            ("part: a prepared sandbox's hand-over and `true`", "part.prepared_handover", bwrap, "bare bwrap")):
        if lat.get(part, {}).get("n"):
            row(f"{name} p50", lat[part]["p50"], floor["p50"], "ms", "(info)",
                _ratio(lat[part]["p50"], floor["p50"]), None, f"{floor_label} p50")
    if relay:
        floor_mb = relay["floor.pubsub_ws"]["mb_per_s"]
        single = relay["rw.single_stream"]["mb_per_s"]
        ratio = _ratio(single, floor_mb)
        row("single-stream relay", single, floor_mb, "MB/s", "≥ 0.8", ratio, ratio >= 0.8, "pub/sub → flask-sock → WS")
        multi = relay["rw.multi_stream"]
        ratio = _ratio(multi["mb_per_s"], floor_mb)
        row(f"{multi['streams']} concurrent streams, verified sha256", multi["mb_per_s"], floor_mb, "MB/s",
            "no loss", ratio, multi["lost"] == 0, "pub/sub → flask-sock → WS")
    if "api_idle_streams" in mem:
        idle = mem["api_idle_streams"]
        per = idle["per_stream_kib"]
        row("API memory per idle open stream", per, 256, "KiB", "≤ 256 KiB", per / 256, per <= 256, "target")
        probes = idle.get("probe_statuses", {})
        served = probes.get("200", 0) / max(1, sum(probes.values()))
        row(f"API still serving while {idle['streams']} streams are open", served * 100, 100, "% of replays → 200",
            "(info)", served, None, "target")
        if idle.get("open_failures"):
            row("idle streams that could not be opened", idle["open_failures"], 0, "of 100", "(info)", 0, None, "target")
    if "worker" in mem:
        growth = mem["worker"]["growth_kib_per_1000_calls_second_half"]
        row("worker RSS growth (second half of soak)", growth, WORKER_GROWTH_LIMIT_KIB_PER_1000, "KiB/1000 calls",
            f"≤ {WORKER_GROWTH_LIMIT_KIB_PER_1000:.0f}", growth / WORKER_GROWTH_LIMIT_KIB_PER_1000,
            growth <= WORKER_GROWTH_LIMIT_KIB_PER_1000, "no growth")
    return rows


def _f(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    out = [f"## runwarden benchmark, {r['mode']} run ({r['when']}, {r['duration_s']:.0f} s)", "",
           f"{m['nproc']} × {m['cpu_model']}, {m['mem_total_gib']} GiB, Linux {m['kernel']}, Python {m['python']}; "
           f"load average {m['loadavg_start'][0]:.2f} at start, {m.get('loadavg_end', [float('nan')])[0]:.2f} at end.",
           "", "### Latency (ms)", "", "| | measurement | n | p50 | p90 | p99 | errors |", "|---|---|--:|--:|--:|--:|--:|"]
    for name, s in r["latency"].items():
        if s.get("n"):
            out.append(f"| {s['kind']} | {s['label']} | {s['n']} | {_f(s['p50'], 2)} | {_f(s['p90'], 2)} | "
                       f"{_f(s['p99'], 2)} | {s['errors']} |")
        else:
            out.append(f"| {s['kind']} | {s['label']} | 0 | – | – | – | {s['errors']} |")
    out += ["", "### Throughput", "", "| | measurement | result | latency p50 / p99 (ms) | failures |",
            "|---|---|--:|--:|--:|"]
    for name, t in r["throughput"].items():
        kind = "floor" if name.startswith("floor.") else "runwarden"
        lat = t["latency"]
        out.append(f"| {kind} | {t['label']} | {_f(t['per_s'], 0)} calls/s | {_f(lat.get('p50', 0), 1)} / "
                   f"{_f(lat.get('p99', 0), 1)} | {t['failures']} |")
    for name, t in r["relay"].items():
        kind = "floor" if name.startswith("floor.") else "runwarden"
        extra = ""
        if "end_to_end_mb_per_s" in t:
            extra = f" ({_f(t['end_to_end_mb_per_s'], 0)} MB/s from POST to exit)"
        if "lost" in t:
            extra += f"; {t['verified']}/{t['streams']} streams verified"
        out.append(f"| {kind} | {t['label']} | {_f(t['mb_per_s'], 0)} MB/s{extra} | | |")
    out += _cpu_table(r["throughput"])
    mem = r["memory"]
    out += ["", "### Memory", "", "| measurement | result |", "|---|---|"]
    if "api_idle_streams" in mem:
        a = mem["api_idle_streams"]
        out.append(f"| API (gunicorn worker) RSS, {a['streams']} idle open streams | {_f(a['rss_before_kib'] / 1024)} → "
                   f"{_f(a['rss_with_streams_kib'] / 1024)} MiB = **{_f(a['per_stream_kib'], 0)} KiB per stream**; "
                   f"threads {a['threads_before']} → {a['threads_with_streams']}; {_f(a['rss_after_close_kib'] / 1024)} MiB "
                   f"after they closed |")
        probes = a.get("probe_statuses", {})
        out.append(f"| API answers while the {a['streams']} streams are open (10 idempotent replays: API + Redis only) | "
                   + ", ".join(f"{n} × {code}" for code, n in sorted(probes.items()))
                   + f"; cancelling them: {a.get('cancel_statuses')} after {a.get('cancel_retries_503', 0)} retries "
                     f"of 503 ({a.get('cancel_s', 0)} s) |")
    if "worker" in mem:
        w = mem["worker"]
        out.append(f"| worker RSS (celery main + {len(w['rss_end_kib']) - 1} children: pool processes, keeper) | "
                   f"{_f(w['rss_start_total_kib'] / 1024)} MiB after warm-up → {_f(w['rss_end_total_kib'] / 1024)} MiB "
                   f"after {w['calls_since_start']:,} calls ({w['soak_calls']:,} in the {w['soak_s']:.0f} s soak); "
                   f"soak second-half slope {w['growth_kib_per_1000_calls_second_half']:+.1f} KiB/1000 calls |")
    out += ["", "### Targets (ratios to the floors measured in this run)", "",
            "| target | runwarden | floor | ratio | goal | met |", "|---|--:|--:|--:|:-:|:-:|"]
    for t in r["targets"]:
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        digits = 0 if t["unit"] in ("calls/s", "MB/s", "KiB") else 2
        floor = (f"{_f(t['floor'], digits)} {t['unit']} ({t['floor_label']})" if t["floor_label"] not in ("target", "no growth")
                 else t["floor_label"])
        out.append(f"| {t['target']} | {_f(t['measured'], digits)} {t['unit']} | {floor} | {t['ratio']:.2f} | "
                   f"{t['goal']} | {met} |")
    if r.get("profiles"):
        out += ["", "### Profiles (py-spy, on-CPU samples; runwarden functions, inclusive)", ""]
        for key, prof in r["profiles"].items():
            top = "; ".join(f"{frame.split(' (')[0]} {pct}%" for frame, pct in prof["inclusive_pct"][:8])
            out.append(f"- `{key}` ({prof['samples']} samples, {prof['file']}): {top}")
    if r["errors"]:
        out += ["", "Errors: " + "; ".join(f"{k}: {v['count']} ({v['examples'][0]})" for k, v in r["errors"].items())]
    return "\n".join(out)


# (row, the floor's roles, runwarden's roles): the same part of the path on each side, the sum of
# its roles. The bare sandboxes' inits are reaped by the host's init, runwarden's by its pool
# processes and keeper (bench/cpu.py), so the worker and the rest are also shown together, where
# both sides count the same things.
_CPU_ROWS = (("HTTP server", (cpu.BARE_API,), (cpu.API,)), ("Celery worker", (cpu.BARE_WORKER,), (cpu.WORKER,)),
             ("Redis", (cpu.REDIS,), (cpu.REDIS,)), ("bench client", (cpu.BENCH,), (cpu.BENCH,)),
             (cpu.REST, (cpu.REST,), (cpu.REST,)),
             ("Celery worker and the rest (each side's sandboxes, wherever reaped)", (cpu.BARE_WORKER, cpu.REST),
              (cpu.WORKER, cpu.REST)),
             ("**machine, all of it**", (cpu.MACHINE,), (cpu.MACHINE,)))


def _cpu_table(throughput: dict[str, Any]) -> list[str]:
    """CPU per call of the two 32-outstanding loads, side by side (bench/cpu.py says how it is counted)."""
    floor = throughput.get("floor.bare_task_x32", {}).get("cpu_ms_per_call")
    ours = throughput.get("rw.shell_true_x32", {}).get("cpu_ms_per_call")
    if not floor or not ours:
        return []
    out = ["", "### CPU per call, 32 outstanding (ms of CPU per completed call)", "",
           "| part | bare Celery task + bare sandbox | runwarden shell `true` | difference |", "|---|--:|--:|--:|"]
    for label, floor_roles, our_roles in _CPU_ROWS:
        a, b = sum(floor.get(role, 0.0) for role in floor_roles), sum(ours.get(role, 0.0) for role in our_roles)
        out.append(f"| {label} | {_f(a, 2)} | {_f(b, 2)} | {b - a:+.2f} |")
    return out


def chart(r: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG", flush=True)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 7), gridspec_kw={"width_ratios": [3, 2]})
    palette = plt.get_cmap("tab20").colors
    for index, (name, s) in enumerate(r["latency"].items()):
        values = sorted(s["samples_ms"])
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        style = {"floor": "--", "part": ":"}.get(s["kind"], "-")
        left.step(values, ys, style, where="post", label=f"{s['label']} (p50 {s['p50']:.1f})", linewidth=1.4,
                  color=palette[(2 * index) % 20 if index < 10 else (2 * index + 1) % 20])
    left.set_xscale("log")
    left.set_xlabel("latency (ms, log scale)")
    left.set_ylabel("fraction of calls ≤ x")
    left.set_title(f"Latency distributions (dashed: floors, dotted: parts), {r['mode']} run")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7, loc="lower right")
    rows = [t for t in r["targets"] if t["met"] is not None]
    names = [t["target"] for t in rows]
    # Normalise every target so that ≤ 1 is good: ceilings as ratio/limit, floors (≥) as limit/ratio.
    scores, colors = [], []
    for t in rows:
        goal = t["goal"]
        if goal.startswith("≤") and "KiB" not in goal and t["floor_label"] != "no growth":
            score = t["ratio"] / float(goal[1:].strip())
        elif goal.startswith("≥"):
            score = float(goal[1:].strip()) / t["ratio"] if t["ratio"] else 10
        elif goal == "no loss":
            score = 0.0 if t["met"] else 2.0
        else:
            score = t["ratio"]
        scores.append(score)
        colors.append("tab:green" if t["met"] else "tab:red")
    limit = 3.0
    right.barh(range(len(rows)), [min(max(score, 0.03), limit) for score in scores], color=colors)
    for y, (t, score) in enumerate(zip(rows, scores)):
        text = f"ratio {t['ratio']:.2f} (goal {t['goal']})" if t["goal"] != "no loss" else \
            ("no loss" if t["met"] else "LOSS")
        right.text(min(max(score, 0.03), limit) + 0.05, y, text + (" →" if score > limit else ""), va="center", fontsize=8)
    right.set_xlim(0, limit + 1.3)
    right.set_yticks(range(len(rows)), names, fontsize=8)
    right.invert_yaxis()
    right.axvline(1.0, color="black", linewidth=1)
    right.set_xlabel("measured / allowed  (≤ 1 meets the target)")
    right.set_title("Targets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
