"""Planner speed and memory: seconds to plan the 3-stage chain and the 5-component PPO graph
(RLinf's 4:1:1:1:1 case) on 8, 16, ..., 1024 devices, and seconds and peak memory on large
clusters (16,384 and 65,536 devices by default).

Both graphs come from the example profiles (``benchmarks/profiles/synthetic_chain3.yaml``,
``benchmarks/profiles/ppo_4_1_1_1_1.yaml``), fitted once (:mod:`m2flow.scheduler.fit`); the
timed call is :func:`m2flow.scheduler.planner.plan_workflow`, best of ``--repeats``:

- ``auto``: the optimal plan (what ``m2flow run plan=auto`` computes);
- ``all``: the optimal plan plus the runner-ups (``runner_ups=True``: the optimum of every
  mode and of every top-level split; what ``m2flow plan`` computes).

Large clusters (``--large``) are planned once each, in a fresh Python process per (graph,
size), so that each peak is its own: ``peak_rss_mb`` is the process's peak resident memory
(``ru_maxrss``), ``plan_peak_mb`` that minus the resident memory before planning (imports and
the fitted profile: what planning itself added), after ``auto`` and then after ``all``.

Targets at 1024 devices: chain <= 0.05 s, PPO <= 1 s. RLinf reports 5.98 s for its planner on
a 3-node graph at 1024 devices (RLinf paper, planner overhead; printed for reference, a
different machine and implementation).

    python benchmarks/planner.py [--repeats 5] [--max-devices 1024] [--large 16384,65536] \\
        [--out benchmarks/results/planner.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from m2flow.scheduler.planner import plan_workflow
from m2flow.scheduler.profile import load_profile, to_workflow
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
CASES = {
    "chain3": HERE / "profiles" / "synthetic_chain3.yaml",
    "ppo_4_1_1_1_1": HERE / "profiles" / "ppo_4_1_1_1_1.yaml",
}
TARGET_S = {"chain3": 0.05, "ppo_4_1_1_1_1": 1.0}  # at 1024 devices, "auto"
RLINF_3NODE_1024_S = 5.98


def best_of(repeats: int, *args, **kwargs) -> tuple[float, object]:
    """Fastest of ``repeats`` calls of ``plan_workflow(*args, **kwargs)`` (seconds, result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = plan_workflow(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def large_child(name: str, n: int) -> None:
    """Plan ``name`` on ``n`` devices once ``auto``, once ``all``; print one JSON row."""
    prof = load_profile(CASES[name])
    wf = to_workflow(prof)
    cap = prof.device_memory_bytes or float("inf")
    base = _rss_mb()
    t0 = time.perf_counter()
    plan = plan_workflow(wf, n, cap)
    t_auto, rss_auto = time.perf_counter() - t0, _rss_mb()
    t0 = time.perf_counter()
    res = plan_workflow(wf, n, cap, runner_ups=True)
    t_all, rss_all = time.perf_counter() - t0, _rss_mb()
    row = {
        "graph": name,
        "devices": n,
        "plan_s": t_auto,
        "plan_with_runner_ups_s": t_all,
        "base_rss_mb": base,
        "plan_peak_mb": rss_auto - base,
        "plan_with_runner_ups_peak_mb": rss_all - base,
        "peak_rss_mb": rss_all,
        "runner_ups": len(res.runner_ups),
        "predicted_step_s": plan.time,
        "plan": plan.shape(),
    }
    print(json.dumps(row))


def large(sizes: list[int], console: Console) -> list[dict]:
    """One fresh process per (graph, size): :func:`large_child`."""
    rows = []
    for name in CASES:
        for n in sizes:
            cmd = [sys.executable, __file__, "--child", name, str(n)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = Table(title="large clusters (one run each, fresh process)")
    for col in ("graph", "devices", "auto s", "all s", "peak MiB", "planning MiB", "plan"):
        table.add_column(col, justify="left" if col in ("graph", "plan") else "right")
    for r in rows:
        table.add_row(
            r["graph"],
            str(r["devices"]),
            f"{r['plan_s']:.2f}",
            f"{r['plan_with_runner_ups_s']:.2f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['plan_with_runner_ups_peak_mb']:.0f}",
            r["plan"],
        )
    console.print(table)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-devices", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "planner.json")
    ap.add_argument(
        "--large", default="16384,65536", help="large device counts, comma-separated ('' skips)"
    )
    ap.add_argument("--child", nargs=2, metavar=("GRAPH", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        large_child(args.child[0], int(args.child[1]))
        return
    counts = [n for n in (2**i for i in range(3, 21)) if n <= args.max_devices]
    rows = []
    for name, path in CASES.items():
        prof = load_profile(path)
        wf = to_workflow(prof)
        cap = prof.device_memory_bytes or float("inf")
        for n in counts:
            t_auto, plan = best_of(args.repeats, wf, n, cap)
            t_all, res = best_of(args.repeats, wf, n, cap, runner_ups=True)
            rows.append(
                {
                    "graph": name,
                    "components": len(wf.components),
                    "batch_size": wf.batch_size,
                    "devices": n,
                    "plan_s": t_auto,
                    "plan_with_runner_ups_s": t_all,
                    "runner_ups": len(res.runner_ups),
                    "predicted_step_s": plan.time,
                    "plan": plan.shape(),
                }
            )
    table = Table(title=f"planner time (best of {args.repeats})")
    for col in ("graph", "devices", "auto s", "all s", "step s", "plan"):
        table.add_column(col, justify="left" if col in ("graph", "plan") else "right")
    for r in rows:
        table.add_row(
            r["graph"],
            str(r["devices"]),
            f"{r['plan_s']:.4f}",
            f"{r['plan_with_runner_ups_s']:.4f}",
            f"{r['predicted_step_s']:.3f}",
            r["plan"],
        )
    console = Console(width=160)
    console.print(table)
    targets = {}
    for name, limit in TARGET_S.items():
        at = [r for r in rows if r["graph"] == name and r["devices"] == 1024]
        if at:
            targets[name] = {"limit_s": limit, "plan_s": at[0]["plan_s"]}
            ok = "met" if at[0]["plan_s"] <= limit else "MISSED"
            console.print(
                f"{name} at 1024 devices: {at[0]['plan_s']:.4f} s (target {limit} s: {ok})"
            )
    console.print(f"RLinf reference: {RLINF_3NODE_1024_S} s for a 3-node graph at 1024 devices")
    large_rows = large([int(x) for x in args.large.split(",") if x], console)
    doc = {
        "benchmark": "planner",
        "machine": {"python": platform.python_version(), "processor": platform.processor()},
        "repeats": args.repeats,
        "rlinf_reference_3node_1024_s": RLINF_3NODE_1024_S,
        "targets_1024": targets,
        "rows": rows,
        "large": large_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
