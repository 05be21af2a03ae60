"""RLBoost's evaluation (section 6, Appendices D-E) as the paper makes it, in emulated time,
deterministic given ``--seed``: every RLBoost run drives the live rollout manager
(``benchmarks/spot_cluster_emu.py``: ``RolloutManager`` on a virtual-time event loop), the
baselines run in ``benchmarks/spot_cluster_baselines.py`` (the same engine model,
``spot_cluster_model.EngineModel``).

One command runs every experiment; each writes its part of
``benchmarks/results/spot_cluster.json`` and prints its table (docs/results/spot_cluster.md puts
them next to the paper's numbers; ``fig10``, ``fig13_17`` are also plotted in ``spot_cluster.png``):

- ``fig10``: veRL, veRL.2x, Disagg.BAL and RLBoost on segments A/B/C (whole 2 h each), 8B /
  14B / 32B; extra rows, ours: the baselines as this project first ran them (through RLBoost's
  manager) and RLBoost's ablations on segment A.
- ``fig11``: 14B with a static number of instances (0-8), relative to 0.
- ``fig12``: 14B, 5 of 6 instances preempted, substitutes arriving one by one: full Algorithm
  1, without memory, without seeding.
- ``fig13`` / ``fig17``: 14B, pull-based vs synchronized weight transfer, instances added
  (Fig. 13) or restarted (Fig. 17) within a step: spot generation throughput over the step.
- ``fig14``: 14B, 3 of 6 instances preempted 100 s / 200 s into a step: migrate vs recompute,
  step-time overhead over no preemption (5 seeds, 95 % interval).
- ``fig16``: the Fig. 10 runs re-priced at spot discounts 0-100 %.
- ``appE``: 14B, response caps 5K-14K: RLBoost (Algorithm 1's ``N_prem``, 12 instances
  offered) and the best static pool, relative to veRL.
- ``tail`` (ours): veRL vs RLBoost on segment A with lighter response-length tails.
- ``agents``: section 4.3's per-node transfer agents, 32B on two nodes: two senders vs one.

    python benchmarks/spot_cluster.py            # everything (26 min on 2 shared cores)
    python benchmarks/spot_cluster.py --quick    # CI size: short runs; Fig. 10 for 8B/14B/32B
                                                 # on segment A; ends with one line per model
    python benchmarks/spot_cluster.py --only fig11 fig14
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from m2flow.scheduler.spot.trace import generate_segment  # noqa: E402
from m2flow.workers.rollout.emulated import ResponseLengths  # noqa: E402
from spot_cluster_baselines import disagg_size as _disagg_size  # noqa: E402
from spot_cluster_baselines import run_baseline  # noqa: E402
from spot_cluster_emu import run_rlboost  # noqa: E402
from spot_cluster_model import (  # noqa: E402
    CAP,
    RESERVED_GPU_PER_H,
    SPOT_INSTANCE_PER_H,
    System,
    Workload,
    summarise,
    with_cap,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "spot_cluster.json"
MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")


def nodes_of(model: str) -> int:
    return 2 if model == "qwen3-32b" else 1  # paper:301-309


def run(
    system: System,
    wl: Workload,
    duration: float,
    trace=None,
    events=(),
    max_steps=10**6,
    warmup: int = 0,
    seed: int = 0,
) -> dict:
    """One run: RLBoost on the live manager (:func:`spot_cluster_emu.run_rlboost`), a
    baseline in ``spot_cluster_baselines.run_baseline``. Same arguments and result."""
    if system.kind == "rlboost":
        return run_rlboost(system, wl, duration, trace, events, max_steps, warmup, seed)
    return run_baseline(system, wl, duration, trace, events, max_steps, warmup, seed)


def verl(model: str, two_x: bool = False) -> System:
    n = nodes_of(model) * (2 if two_x else 1)
    return System(
        "veRL.2x" if two_x else "veRL",
        "verl",
        n,
        scale_eff=0.9 if two_x else 1.0,
        dispatch="static",
        rebalance=False,
        seeding=False,
    )


def disagg(model: str, k: int) -> System:
    return System(
        "Disagg.BAL",
        "disagg",
        nodes_of(model),
        dispatch="shared",
        rebalance=False,
        seeding=False,
        weights="sync",
        instances=k,
    )


def rlboost(model: str, name: str = "RLBoost", **over) -> System:
    return System(name, "rlboost", nodes_of(model), **over)


def disagg_size(wl: Workload, steps: int = 2) -> dict:
    """Disagg.BAL's instance count as StreamRL's resource optimizer balances the stages
    (paper:322): rollout time taken to scale as ``1 / k`` over ``k`` reserved 2xH100 instances
    (its linear model), ``k = ceil(R_1 / T_train)`` with ``R_1`` one instance's rollout of the
    step and ``T_train`` the step's training + reshard (means over ``steps`` emulated steps)."""
    return _disagg_size(wl, nodes_of(wl.model), steps)


# ---------------------------------------------------------------------------------------------


def fig10(a, out: dict) -> None:
    res = out.setdefault("fig10", {"runs": {}, "disagg_size": {}})
    for model in a.models:
        wl = Workload(model, seed=a.seed)
        size = disagg_size(wl)
        res["disagg_size"][model] = size
        k = size["k"]
        systems = [(verl(model), None), (disagg(model, k), None)]
        if nodes_of(model) == 1:
            systems.insert(1, (verl(model, two_x=True), None))
        for seg in a.segments:
            systems.append((rlboost(model, f"RLBoost/{seg}"), seg))
        # ours: the baselines as first built, through RLBoost's own manager
        systems.append(
            (
                rlboost(model, "ours: veRL-like (RLBoost fallback, no instances)", n_prem_fixed=0),
                None,
            )
        )
        systems.append(
            (
                rlboost(
                    model,
                    "ours: Disagg-like (RLBoost pool, no seeding)",
                    n_prem_fixed=k,
                    seeding=False,
                    reserved_price=True,
                ),
                [(0.0, k)],
            )
        )
        if not a.no_ablations:
            seg = a.segments[0]
            for name, over in (
                ("no memory", {"memory": False}),
                ("no seeding", {"seeding": False}),
                ("round robin", {"dispatch": "round_robin"}),
                ("no rebalance", {"rebalance": False}),
                ("recompute", {"migration": "recompute"}),
                ("sync weights", {"weights": "sync"}),
                ("old seeding rule", {"seed_share": "all"}),
            ):
                systems.append((rlboost(model, f"ours: ablation {name}/{seg}", **over), seg))
        for sy, seg in systems:
            trace = generate_segment(seg, seed=a.seed) if isinstance(seg, str) else seg
            t0 = time.time()
            r = run(sy, wl, a.duration, trace, seed=a.seed)
            r["segment"] = seg if isinstance(seg, str) else None
            r["wall_s"] = time.time() - t0
            res["runs"][f"{model}/{sy.name}"] = r
            print(
                f"  {model}/{sy.name}: {r['throughput']:,.0f} tok/s {r['tokens_per_dollar']:,.0f}"
                f" tok/$ held {r['avg_held']:.2f} steps {r['steps']} ({r['wall_s']:.1f} s)",
                flush=True,
            )


def fig11(a, out: dict) -> None:
    wl = Workload("qwen3-14b", seed=a.seed)
    rows = {}
    for n in a.static_counts:
        sy = rlboost(wl.model, f"static {n}", n_prem_fixed=n)
        r = run(sy, wl, math.inf, [(0.0, n)], max_steps=a.steps, warmup=a.warmup, seed=a.seed)
        rows[n] = {
            k: r[k] for k in ("throughput", "tokens_per_dollar", "step_s", "avg_held", "spot_share")
        }
        rows[n]["t_seed"] = r["records"][-1]["t_seed"]
        old = rlboost(wl.model, f"static {n}, old seeding rule", n_prem_fixed=n, seed_share="all")
        f = run(old, wl, math.inf, [(0.0, n)], max_steps=a.steps, warmup=a.warmup, seed=a.seed)
        rows[n]["seed_all"] = {k: f[k] for k in ("throughput", "tokens_per_dollar", "spot_share")}
        print(
            f"  fig11 n={n}: {r['throughput']:,.0f} tok/s {r['tokens_per_dollar']:,.0f} tok/$",
            flush=True,
        )
    base = rows[min(rows)]
    for row in rows.values():
        row["x_throughput"] = row["throughput"] / base["throughput"]
        row["x_tokens_per_dollar"] = row["tokens_per_dollar"] / base["tokens_per_dollar"]
        old = row["seed_all"]
        old["x_throughput"] = old["throughput"] / base["throughput"]
        old["x_tokens_per_dollar"] = old["tokens_per_dollar"] / base["tokens_per_dollar"]
    out["fig11"] = {"model": wl.model, "rows": rows, "steps": a.steps, "warmup": a.warmup}


def fig12(a, out: dict) -> None:
    """6 instances; 5 preempted at ``t_p``; one substitute every ``gap`` s until 6 again."""
    wl = Workload("qwen3-14b", seed=a.seed)
    t_p, gap = a.fig12_start, a.fig12_gap
    trace = [(0.0, 6), (t_p, 1)] + [(t_p + gap * i, 1 + i) for i in range(1, 6)]
    end = t_p + gap * 5 + a.fig12_tail
    res = {"trace": trace, "t_preempt": t_p, "end": end, "runs": {}}
    for name, over in (
        ("full", {}),
        ("w/o memory", {"memory": False}),
        ("w/o seeding", {"seeding": False}),
    ):
        r = run(rlboost(wl.model, name, **over), wl, end, trace, seed=a.seed)
        rec = [x for x in r["records"] if x["t_start"] >= t_p]
        s = summarise(rec)
        res["runs"][name] = {
            **s,
            "steps_detail": [
                {
                    k: x[k]
                    for k in (
                        "t_start",
                        "step_s",
                        "t_seed",
                        "n_prem",
                        "n_bar",
                        "n_hat",
                        "memory_hit",
                        "t_train_wait",
                        "t_remote_wait",
                    )
                }
                for x in rec
            ],
        }
        print(f"  fig12 {name}: {s['throughput']:,.0f} tok/s over {s['steps']} steps", flush=True)
    full = res["runs"]["full"]["throughput"]
    for v in res["runs"].values():
        v["vs_full"] = v["throughput"] / full - 1
    out["fig12"] = res


def _gen_timeline(r: dict, t0: float, t1: float, bin_s: float = 10.0) -> list[float]:
    """Spot tokens/s in ``bin_s`` bins over ``[t0, t1)`` (blocks spread evenly over their span)."""
    nb = max(1, math.ceil((t1 - t0) / bin_s))
    out = np.zeros(nb)
    for b0, b1, made in r["timeline"]:
        if b1 <= t0 or b0 >= t1 or b1 <= b0:
            continue
        for i in range(max(0, int((b0 - t0) // bin_s)), min(nb, int((b1 - t0) // bin_s) + 1)):
            lo, hi = max(b0, t0 + i * bin_s), min(b1, t0 + (i + 1) * bin_s)
            if hi > lo:
                out[i] += made * (hi - lo) / (b1 - b0)
    return list(out / bin_s)


def fig13_17(a, out: dict) -> None:
    wl = Workload("qwen3-14b", seed=a.seed)
    k = a.warmup + 1  # the step with the scenario
    cases = {
        "fig13": ([(0.0, 1)], [(k, 20.0 * i, "add", 1) for i in range(1, 6)]),
        "fig17": ([(0.0, 6)], [(k, 40.0 * i, "restart", 1) for i in range(1, 4)]),
    }
    for fig, (trace, events) in cases.items():
        res = {"events": events, "runs": {}}
        for mode in ("pull", "sync", "pull, old seeding rule"):
            w = mode.split(",")[0]
            share = "all" if "old" in mode else None
            sy = rlboost(wl.model, mode, weights=w, n_prem_fixed=6, seed_share=share)
            r = run(sy, wl, math.inf, trace, events, max_steps=k + 2, seed=a.seed)
            st = r["records"][k]
            t1 = st["t_start"] + st["step_s"]
            res["runs"][mode] = {
                "step_s": st["step_s"],
                "next_step_s": r["records"][k + 1]["step_s"],
                "spot_tokens": st["spot_tokens"],
                "push_s": st["push_s"],
                "gen_tps": _gen_timeline(r, st["t_start"], t1),
                "mean_gen_tps": st["spot_tokens"] / st["step_s"],
            }
            print(
                f"  {fig} {mode}: step {st['step_s']:.0f} s, spot tokens/s "
                f"{st['spot_tokens'] / st['step_s']:,.0f}",
                flush=True,
            )
        out[fig] = res


def fig14(a, out: dict) -> None:
    k = a.warmup + 1
    res = {}
    for t_rel in (100.0, 200.0):
        over = {"migrate": [], "recompute": []}
        for s in range(a.fig14_seeds):
            wl = Workload("qwen3-14b", seed=a.seed + s)
            base = None
            for mode in ("none", "migrate", "recompute"):
                ev = [] if mode == "none" else [(k, t_rel, "preempt", 3)]
                mig = "recompute" if mode == "recompute" else "tokens"
                sy = rlboost(wl.model, mode, n_prem_fixed=6, migration=mig)
                r = run(sy, wl, math.inf, [(0.0, 6)], ev, max_steps=k + 1, seed=a.seed + s)
                step_s = r["records"][k]["step_s"]
                if mode == "none":
                    base = step_s
                else:
                    over[mode].append(step_s - base)
        row = {}
        for mode, xs in over.items():
            row[mode] = {
                "mean_s": float(np.mean(xs)),
                "p2.5": float(np.percentile(xs, 2.5)),
                "p97.5": float(np.percentile(xs, 97.5)),
                "all": xs,
            }
        rc = row["recompute"]["mean_s"]
        row["reduction"] = 1 - row["migrate"]["mean_s"] / rc if rc > 0 else None
        res[f"{int(t_rel)}s"] = row
        print(
            f"  fig14 at {t_rel:.0f} s: migrate +{row['migrate']['mean_s']:.1f} s, recompute "
            f"+{rc:.1f} s, reduction {row['reduction']}",
            flush=True,
        )
    out["fig14"] = res


def fig16(a, out: dict) -> None:
    """Re-price Fig. 10's RLBoost runs: spot per-GPU price = on-demand x (1 - discount)."""
    runs = out.get("fig10", {}).get("runs", {})
    res = {"table2_discount": 1 - SPOT_INSTANCE_PER_H / (2 * RESERVED_GPU_PER_H), "models": {}}
    for model in a.models:
        base = runs.get(f"{model}/veRL")
        if base is None:
            continue
        rows = {}
        for d in np.round(np.linspace(0, 1, 11), 2):
            price = 2 * RESERVED_GPU_PER_H * (1 - d)
            effs = [
                summarise(runs[f"{model}/RLBoost/{s}"]["records"], 0, price)["tokens_per_dollar"]
                for s in a.segments
                if f"{model}/RLBoost/{s}" in runs
            ]
            rows[f"{d:.1f}"] = float(np.mean(effs)) / base["tokens_per_dollar"]
        ref = {
            n: runs[f"{model}/{n}"]["tokens_per_dollar"] / base["tokens_per_dollar"]
            for n in ("veRL.2x", "Disagg.BAL")
            if f"{model}/{n}" in runs
        }
        even = next((float(d) for d, v in rows.items() if v >= 1.0), None)
        res["models"][model] = {"x_verl_by_discount": rows, "baselines": ref, "break_even": even}
    out["fig16"] = res


def appendix_e(a, out: dict) -> None:
    res = {}
    for cap in a.caps:
        wl = with_cap(Workload("qwen3-14b", seed=a.seed), cap)
        base = run(verl(wl.model), wl, math.inf, max_steps=max(3, a.warmup + 2), warmup=1)
        alg = run(
            rlboost(wl.model, "RLBoost"),
            wl,
            math.inf,
            [(0.0, 12)],
            max_steps=a.steps,
            warmup=a.warmup,
            seed=a.seed,
        )
        static = {}
        for n in a.appe_counts:
            r = run(
                rlboost(wl.model, f"static {n}", n_prem_fixed=n),
                wl,
                math.inf,
                [(0.0, n)],
                max_steps=a.steps,
                warmup=a.warmup,
                seed=a.seed,
            )
            static[n] = (
                r["tokens_per_dollar"] / base["tokens_per_dollar"],
                r["throughput"] / base["throughput"],
            )
        best = max(static, key=lambda n: static[n][0])
        res[str(cap)] = {
            "verl_step_s": base["step_s"],
            "alg1": {
                "x_throughput": alg["throughput"] / base["throughput"],
                "x_tokens_per_dollar": alg["tokens_per_dollar"] / base["tokens_per_dollar"],
                "n_prem": [x["n_prem"] for x in alg["records"]],
                "held": alg["avg_held"],
            },
            "best_static": {
                "n": best,
                "x_tokens_per_dollar": static[best][0],
                "x_throughput": static[best][1],
            },
            "static": {str(n): v for n, v in static.items()},
        }
        print(
            f"  appE cap {cap}: Alg.1 x{res[str(cap)]['alg1']['x_throughput']:.2f} thr "
            f"N_prem {alg['records'][-1]['n_prem']}; best static n={best} "
            f"x{static[best][1]:.2f} thr x{static[best][0]:.2f} tok/$",
            flush=True,
        )
    out["appE"] = res


def tail(a, out: dict) -> None:
    """Ours, not the paper's: the same comparison (veRL vs RLBoost on segment A) with lighter
    response-length tails. The lognormal's ``sigma`` varies; its median moves so that the
    uncapped mean stays that of the default (3000 exp(1/2) = 4,946 tokens)."""
    res = {}
    mean = 3000.0 * math.exp(0.5)
    for model in a.tail_models:
        for sigma in a.sigmas:
            lengths = ResponseLengths(mean / math.exp(sigma**2 / 2), sigma, CAP)
            wl = Workload(model, lengths, a.seed)
            base = run(verl(model), wl, a.duration)
            rl = run(
                rlboost(model, "RLBoost/A"), wl, a.duration, generate_segment("A", seed=a.seed)
            )
            capped = float(
                np.mean(
                    lengths.lengths(a.seed, [(0, p, j) for p in range(128) for j in range(8)])
                    >= CAP
                )
            )
            key = f"{model}/sigma={sigma}"
            res[key] = {
                "median": lengths.median,
                "sigma": sigma,
                "capped_share": capped,
                "verl_step_s": base["step_s"],
                "x_throughput": rl["throughput"] / base["throughput"],
                "x_tokens_per_dollar": rl["tokens_per_dollar"] / base["tokens_per_dollar"],
                "held": rl["avg_held"],
            }
            r = res[key]
            print(f"  tail {key}: x{r['x_throughput']:.2f}, x{r['x_tokens_per_dollar']:.2f} tok/$")
    out["tail"] = res


def agents(a, out: dict) -> None:
    """Section 4.3's per-node transfer agents with round-robin pairing: 32B on two training
    nodes, segment A, pulls spread over both nodes' frontend NICs or all sent by one; with
    the seeding share and the old seeding rule."""
    wl = Workload("qwen3-32b", seed=a.seed)
    seg = generate_segment(a.segments[0], seed=a.seed)
    res = {}
    for share in (None, "all"):
        for n in (2, 1):
            sy = rlboost(wl.model, f"{n} agents", agents=n, seed_share=share)
            r = run(sy, wl, a.duration, seg, seed=a.seed)
            key = f"{n}" + (", old seeding rule" if share else "")
            res[key] = {k: r[k] for k in ("throughput", "tokens_per_dollar", "step_s", "steps")}
            print(f"  agents {key}: {r['throughput']:,.0f} tok/s, step {r['step_s']:.1f} s")
    out["agents"] = res


EXPERIMENTS = {
    "fig10": fig10,
    "fig11": fig11,
    "fig12": fig12,
    "fig13_17": fig13_17,
    "fig14": fig14,
    "fig16": fig16,
    "appE": appendix_e,
    "tail": tail,
    "agents": agents,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size: short runs, segment A")
    ap.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), help="these experiments")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--segments", nargs="+", default=["A", "B", "C"])
    ap.add_argument("--duration", type=float, default=7200.0, help="emulated s per segment")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results JSON (--quick: a temp file)")
    a = ap.parse_args()
    a.steps, a.warmup = 12, 3
    a.static_counts = list(range(0, 9))
    a.fig12_start, a.fig12_gap, a.fig12_tail = 2000.0, 600.0, 1800.0
    a.fig14_seeds = 5
    a.caps = [5120, 8192, 10240, 12288, CAP]
    a.appe_counts = list(range(1, 9))
    a.tail_models, a.sigmas = ["qwen3-8b", "qwen3-14b"], [0.5, 0.75, 1.0]
    if a.quick:
        a.segments, a.duration, a.no_ablations = ["A"], 1800.0, True
        a.steps, a.warmup, a.static_counts, a.fig14_seeds = 5, 2, [0, 1, 3, 6], 2
        a.fig12_start, a.fig12_gap, a.fig12_tail = 800.0, 300.0, 600.0
        a.caps, a.appe_counts = [5120, CAP], [2, 4, 6]
        a.tail_models, a.sigmas = ["qwen3-8b"], [0.5, 1.0]
    todo = a.only or list(EXPERIMENTS)
    if a.out is None:
        a.out = str(Path(tempfile.gettempdir()) / "spot_cluster_quick.json" if a.quick else OUT)
    path = Path(a.out)
    out = json.loads(path.read_text()) if a.only and path.exists() else {}
    out["settings"] = {k: v for k, v in vars(a).items() if k not in ("only", "out")}
    out["settings"]["time"] = "emulated seconds, deterministic given the seed"
    wall0 = time.time()
    for name in todo:
        print(f"{name} ...", flush=True)
        t0 = time.time()
        EXPERIMENTS[name](a, out)
        out.setdefault("wall_s", {})[name] = time.time() - t0
        _save(out, path)
    print(f"wall {time.time() - wall0:.0f} s")
    from spot_cluster_report import markdown, plot

    print(markdown(out))
    plot(out, path.with_suffix(".png"))
    for line in summary_lines(out, a.models, a.segments[0]):
        print(line)


def summary_lines(out: dict, models, segment: str) -> list[str]:
    """Fig. 10's headline per model: RLBoost on ``segment`` vs veRL, from the runs in ``out``
    (``model=<name> throughput_vs_verl=<x> tokens_per_dollar_vs_verl=<y>``)."""
    runs = out.get("fig10", {}).get("runs", {})
    lines = []
    for m in models:
        base, rl = runs.get(f"{m}/veRL"), runs.get(f"{m}/RLBoost/{segment}")
        if base is None or rl is None:
            continue
        x = rl["throughput"] / base["throughput"]
        y = rl["tokens_per_dollar"] / base["tokens_per_dollar"]
        lines.append(f"model={m} throughput_vs_verl={x:.3f} tokens_per_dollar_vs_verl={y:.3f}")
    return lines


def _save(out: dict, path: Path) -> None:
    slim = json.loads(json.dumps(out, default=float))
    for r in slim.get("fig10", {}).get("runs", {}).values():
        r.pop("timeline", None)  # spot blocks: large; the per-step records stay
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(slim, indent=1) + "\n")


if __name__ == "__main__":
    main()
