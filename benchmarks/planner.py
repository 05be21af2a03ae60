"""Planner speed and memory: seconds to plan the 3-stage chain and the 5-component PPO graph
(RLinf's 4:1:1:1:1 case) on 8, 16, ..., 1024 devices, and seconds and peak memory on large
clusters (16,384 and 65,536 devices by default).

Both graphs come from the example profiles (``benchmarks/profiles/synthetic_chain3.yaml``,
``benchmarks/profiles/ppo_4_1_1_1_1.yaml``), fitted once (:mod:`m2flow.scheduler.plan.fit`); the
timed call is :func:`m2flow.scheduler.plan.planner.plan_workflow`, best of ``--repeats``:

- ``auto``: the optimal plan (what ``m2flow run plan=auto`` computes);
- ``all``: the optimal plan plus the runner-ups (``runner_ups=True``: the optimum of every
  mode and of every top-level split; what ``m2flow plan`` computes);
- ``staleness``: the rows of every (K, placement) for K = 0..4 and the choice
  (:func:`m2flow.scheduler.plan.staleness.plan_staleness`: the best plan of every mode plus the
  disaggregated split searched per K; what ``m2flow plan --staleness`` adds, issue 32 item 4).

Large clusters (``--large``) are planned once each, in a fresh Python process per (graph,
size), so that each peak is its own: ``peak_rss_mb`` is the process's peak resident memory
(``ru_maxrss``), ``plan_peak_mb`` that minus the resident memory before planning (imports and
the fitted profile: what planning itself added), after ``auto`` and then after ``all``.

Targets at 1024 devices: chain <= 0.05 s, PPO <= 0.5 s, PPO with the staleness dimension
<= 1 s; PPO at 16,384 devices <= 5 s. RLinf
reports 5.98 s for its planner on a 3-node graph at 1024 devices (RLinf paper, planner
overhead; printed for reference, a different machine and implementation).

``--baseline ROOT`` also times the planner of another checkout (its ``scheduler/``, e.g. a
``git worktree`` of an older commit) against this one in the same run: one long-lived process
per planner, the two asked in turn (the order alternating) for the same plan, ``--compare-
repeats`` times per (graph, size) of ``--compare`` after one untimed warm-up each, which must
give the same plan and predicted step time (to 1e-9). Per case: the median seconds of each,
the speed-up (baseline median / this median) and the spread of the per-turn ratios (min to
max), in wall and in CPU time (the process's; steadier than wall under contention), with the
1-minute load average before and after, since timings on a shared machine swing with its
load.

    python benchmarks/planner.py [--repeats 5] [--max-devices 1024] [--large 16384,65536] \\
        [--baseline ROOT] [--compare chain3:1024,ppo_4_1_1_1_1:1024,ppo_4_1_1_1_1:16384] \\
        [--compare-repeats 7] [--out benchmarks/results/planner.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
CASES = {
    "chain3": HERE / "profiles" / "synthetic_chain3.yaml",
    "ppo_4_1_1_1_1": HERE / "profiles" / "ppo_4_1_1_1_1.yaml",
}
TARGET_S = {"chain3": 0.05, "ppo_4_1_1_1_1": 0.5}  # at 1024 devices, "auto"
TARGET_LARGE_S = {("ppo_4_1_1_1_1", 16384): 5.0}
TARGET_STALENESS_S = {"ppo_4_1_1_1_1": 1.0}  # at 1024 devices, K = 0..4
RLINF_3NODE_1024_S = 5.98
COMPARE = "chain3:1024,ppo_4_1_1_1_1:1024,ppo_4_1_1_1_1:16384"


def use_scheduler(root: str | None):
    """The planner API (``plan_workflow``, ``load_profile``, ``to_workflow``) of the
    ``scheduler/`` of checkout ``root`` (registered as ``m2flow.scheduler`` before anything
    imports it; ``None``: the installed one)."""
    if root:
        pkg = Path(root).resolve() / "scheduler"
        spec = importlib.util.spec_from_file_location(
            "m2flow.scheduler", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["m2flow.scheduler"] = mod
        spec.loader.exec_module(mod)
    from m2flow.scheduler.plan.planner import plan_workflow
    from m2flow.scheduler.plan.profile import load_profile, to_workflow

    return plan_workflow, load_profile, to_workflow


def best_of(repeats: int, *args, fn=None, **kwargs) -> tuple[float, object]:
    """Fastest of ``repeats`` calls of ``fn(*args, **kwargs)`` (seconds, result; ``fn``:
    ``plan_workflow`` by default)."""
    fn = fn or use_scheduler(None)[0]
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def large_child(name: str, n: int) -> None:
    """Plan ``name`` on ``n`` devices once ``auto``, once ``all``; print one JSON row."""
    plan_workflow, load_profile, to_workflow = use_scheduler(None)
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


def serve(root: str | None) -> None:
    """Child of :func:`compare`: with the planner of checkout ``root``, plan each request
    ``GRAPH N`` read from stdin and answer one JSON line (seconds, predicted step, plan)."""
    plan_workflow, load_profile, to_workflow = use_scheduler(root)
    loaded = {}
    for line in sys.stdin:
        name, n = line.split()
        if name not in loaded:
            prof = load_profile(CASES[name])
            loaded[name] = (to_workflow(prof), prof.device_memory_bytes or float("inf"))
        wf, cap = loaded[name]
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_workflow(wf, int(n), cap)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"s": dt, "cpu_s": cpu, "step_s": plan.time, "plan": plan.shape()}))
        sys.stdout.flush()


def compare(baseline: str, cases: list[tuple[str, int]], repeats: int, console) -> list[dict]:
    """This planner against ``baseline``'s, interleaved (module docstring)."""
    procs = {
        label: subprocess.Popen(
            [sys.executable, __file__, "--serve", root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for label, root in (("this", ""), ("baseline", baseline))
    }

    def ask(label, name, n):
        p = procs[label]
        p.stdin.write(f"{name} {n}\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    rows = []
    try:
        for name, n in cases:
            load0 = os.getloadavg()[0]
            first = {lb: ask(lb, name, n) for lb in procs}  # warm-up; the plans must agree
            a, b = first["this"], first["baseline"]
            same = a["plan"] == b["plan"] and abs(a["step_s"] - b["step_s"]) <= 1e-9 * abs(
                b["step_s"]
            )
            times, cpu = {lb: [] for lb in procs}, {lb: [] for lb in procs}
            for r in range(repeats):
                for lb in ("this", "baseline") if r % 2 == 0 else ("baseline", "this"):
                    got = ask(lb, name, n)
                    times[lb].append(got["s"])
                    cpu[lb].append(got["cpu_s"])
            ratios = [b_s / t_s for t_s, b_s in zip(times["this"], times["baseline"])]
            cpu_ratios = [b_s / t_s for t_s, b_s in zip(cpu["this"], cpu["baseline"])]
            rows.append(
                {
                    "graph": name,
                    "devices": n,
                    "this_s": times["this"],
                    "baseline_s": times["baseline"],
                    "this_median_s": statistics.median(times["this"]),
                    "baseline_median_s": statistics.median(times["baseline"]),
                    "speedup": statistics.median(times["baseline"])
                    / statistics.median(times["this"]),
                    "speedup_min": min(ratios),
                    "speedup_max": max(ratios),
                    "this_cpu_s": cpu["this"],
                    "baseline_cpu_s": cpu["baseline"],
                    "cpu_speedup": statistics.median(cpu["baseline"])
                    / statistics.median(cpu["this"]),
                    "cpu_speedup_min": min(cpu_ratios),
                    "cpu_speedup_max": max(cpu_ratios),
                    "same_plan": same,
                    "load_before": load0,
                    "load_after": os.getloadavg()[0],
                    "plan": a["plan"],
                    "predicted_step_s": a["step_s"],
                }
            )
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()
    table = Table(title=f"against {baseline} (interleaved, {repeats} turns, medians)")
    for col in ("graph", "devices", "this s", "baseline s", "speed-up", "per turn", "CPU s",
                "CPU speed-up", "per turn (CPU)", "same plan", "load"):  # fmt: skip
        table.add_column(col, justify="left" if col == "graph" else "right")
    for r in rows:
        table.add_row(
            r["graph"],
            str(r["devices"]),
            f"{r['this_median_s']:.3f}",
            f"{r['baseline_median_s']:.3f}",
            f"{r['speedup']:.2f}x",
            f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}x",
            " / ".join(f"{statistics.median(r[x]):.3f}" for x in ("this_cpu_s", "baseline_cpu_s")),
            f"{r['cpu_speedup']:.2f}x",
            f"{r['cpu_speedup_min']:.2f}-{r['cpu_speedup_max']:.2f}x",
            "yes" if r["same_plan"] else "NO",
            f"{r['load_before']:.1f}-{r['load_after']:.1f}",
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
    ap.add_argument("--baseline", help="checkout whose scheduler/ to time against this one")
    ap.add_argument("--compare", default=COMPARE, help="GRAPH:N,... timed against --baseline")
    ap.add_argument("--compare-repeats", type=int, default=7)
    ap.add_argument("--child", nargs=2, metavar=("GRAPH", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        large_child(args.child[0], int(args.child[1]))
        return
    if args.serve is not None:
        serve(args.serve or None)
        return
    plan_workflow, load_profile, to_workflow = use_scheduler(None)
    from m2flow.scheduler.plan.staleness import plan_staleness

    counts = [n for n in (2**i for i in range(3, 21)) if n <= args.max_devices]
    rows = []
    for name, path in CASES.items():
        prof = load_profile(path)
        wf = to_workflow(prof)
        cap = prof.device_memory_bytes or float("inf")
        for n in counts:
            t_auto, plan = best_of(args.repeats, wf, n, cap)
            t_all, res = best_of(args.repeats, wf, n, cap, runner_ups=True)
            t_st, st = best_of(args.repeats, wf, n, cap, fn=plan_staleness, max_staleness=4)
            rows.append(
                {
                    "graph": name,
                    "components": len(wf.components),
                    "batch_size": wf.batch_size,
                    "devices": n,
                    "plan_s": t_auto,
                    "plan_with_runner_ups_s": t_all,
                    "plan_staleness_s": t_st,
                    "staleness_choice": {"k": st.chosen.k, "placement": st.chosen.placement},
                    "runner_ups": len(res.runner_ups),
                    "predicted_step_s": plan.time,
                    "plan": plan.shape(),
                }
            )
    table = Table(title=f"planner time (best of {args.repeats})")
    for col in ("graph", "devices", "auto s", "all s", "staleness s", "step s", "plan"):
        table.add_column(col, justify="left" if col in ("graph", "plan") else "right")
    for r in rows:
        table.add_row(
            r["graph"],
            str(r["devices"]),
            f"{r['plan_s']:.4f}",
            f"{r['plan_with_runner_ups_s']:.4f}",
            f"{r['plan_staleness_s']:.4f}",
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
    for name, limit in TARGET_STALENESS_S.items():
        at = [r for r in rows if r["graph"] == name and r["devices"] == 1024]
        if at:
            t, base = at[0]["plan_staleness_s"], at[0]["plan_s"]
            targets[f"{name}_staleness"] = {"limit_s": limit, "plan_s": t}
            console.print(
                f"{name} at 1024 devices with staleness K=0..4: {t:.4f} s, {t / base:.2f}x auto "
                f"(target {limit} s: {'met' if t <= limit else 'MISSED'})"
            )
    console.print(f"RLinf reference: {RLINF_3NODE_1024_S} s for a 3-node graph at 1024 devices")
    large_rows = large([int(x) for x in args.large.split(",") if x], console)
    for r in large_rows:
        limit = TARGET_LARGE_S.get((r["graph"], r["devices"]))
        if limit is not None:
            ok = "met" if r["plan_s"] <= limit else "MISSED"
            console.print(
                f"{r['graph']} at {r['devices']} devices: {r['plan_s']:.2f} s (target {limit} s: "
                f"{ok})"
            )
    compared = []
    if args.baseline:
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.compare.split(",") if c]
        compared = compare(args.baseline, cases, args.compare_repeats, console)
    doc = {
        "benchmark": "planner",
        "machine": {"python": platform.python_version(), "processor": platform.processor()},
        "repeats": args.repeats,
        "rlinf_reference_3node_1024_s": RLINF_3NODE_1024_S,
        "targets_1024": targets,
        "rows": rows,
        "large": large_rows,
        "baseline": args.baseline,
        "compared": compared,
        "load_average": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
