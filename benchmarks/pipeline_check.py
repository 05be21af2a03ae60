"""Pipelined GRPO plans at fixed granularities against the planner's pick, predicted vs measured.

    python benchmarks/pipeline_check.py [--profile P] [--granularities 16,8] [--repeats 3]

The planner only runs the plan it picks, so a pipelined plan it rejects is never measured by
``benchmarks/plan_modes.py``. This script measures them anyway. It takes the hybrid shape
``S(rollout [0] | T(reward, actor) [1])`` (rollout on device 0; reward and actor time-sharing
device 1) at each granularity ``m``, plus the planner's own pick. The prediction for each comes
from the same profile and the same cost model the planner uses
(:func:`m2flow.scheduler.plan.cost.spatial_time` with the profile's 1-device times and per-chunk
overheads, plus ``step_overhead_s``). Every run resumes from one shared warm-started checkpoint
and measures ``--steps`` steps after ``--skip``; the plans run round-robin, ``--repeats``
times. Reported per plan: predicted and measured seconds per step (median of the steps pooled
over the runs), the error, the run medians, CPU stolen per run, and each group's measured busy
seconds next to the model's (``t + (k - 1) * o``). JSON goes to
``benchmarks/results/pipeline_check.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from m2flow.scheduler.plan.cost import spatial_time
from plan_modes import ROOT, GiB, Runs, warm_start

from m2flow.core.placement import Placement
from m2flow.run.planning import load_profile, plan_from_profile


def _pipelined(prof, m: int) -> tuple[Placement, dict[str, float]]:
    """``S(rollout [0] | T(reward, actor) [1])`` in chunks of ``m``: placement and the model's
    busy seconds per group."""
    c = prof.components
    k = prof.batch_size // m
    t = {g: c[g].points[0].seconds for g in ("rollout", "reward", "actor")}
    o = {g: c[g].chunk_overhead_s for g in t}
    step = spatial_time(
        t["rollout"], t["reward"] + t["actor"], o["rollout"], o["reward"] + o["actor"], k
    )
    placement = Placement(
        mode="hybrid",
        groups={"rollout": [0], "reward": [1], "actor": [1]},
        granularity={"rollout->reward": m, "reward->actor": prof.batch_size},
        predicted_step_s=float(step) + prof.step_overhead_s,
        tree=f"S(rollout [0] | T(reward, actor) [1]), m = {m} ({k} chunks)",
    )
    return placement, {g: t[g] + (k - 1) * o[g] for g in t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT / "benchmarks" / "profiles" / "grpo_2cpu.yaml"))
    ap.add_argument("--granularities", default="16,8", help="prompts per chunk, divisors of M")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default="scratch/pipeline_check")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline_check.json"))
    args = ap.parse_args()

    prof = load_profile(args.profile)
    plans: dict[str, tuple[Placement, dict[str, float]]] = {}
    _, pick = plan_from_profile(prof, 2, 16 * GiB, "auto")
    plans["pick"] = (pick, dict(pick.predicted))
    for m in (int(x) for x in args.granularities.split(",")):
        if prof.batch_size % m:
            raise SystemExit(f"--granularities: {m} does not divide the batch {prof.batch_size}")
        plans[f"m={m}"] = _pipelined(prof, m)

    resumed = warm_start(
        Path(args.work), ["cluster.devices_per_node=2", "trainer.eval_every=100000"]
    )
    runs = {n: Runs() for n in plans}
    for rep in range(args.repeats):
        for name, (placement, _) in plans.items():
            overrides = resumed(f"{name.replace('=', '')}-{rep}") + [
                f"trainer.steps={1 + args.steps}"
            ]
            runs[name].measure(overrides, placement, args.skip)
            print(f"{name} run {rep}: {runs[name].medians[-1]:.4f} s/step", flush=True)

    rows = []
    print(
        f"\n{'plan':<8} {'predicted s':>12} {'measured s':>11} {'error':>8}  busy measured (model)"
    )
    for name, (placement, model) in plans.items():
        r = runs[name]
        measured = statistics.median(r.steps)
        predicted = placement.predicted_step_s
        med = r.busy_s()
        rows.append(
            {
                "plan": name,
                "tree": placement.tree,
                "predicted_step_s": predicted,
                "measured_step_s": measured,
                "error": (measured - predicted) / measured,
                "measured_runs_s": r.medians,
                "steal_per_run": r.steal,
                "busy_s": med,
                "model_busy_s": model,
            }
        )
        shown = ", ".join(f"{g} {med[g]:.3f} ({model.get(g, 0.0):.3f})" for g in med)
        print(f"{name:<8} {predicted:>12.4f} {measured:>11.4f} {rows[-1]['error']:>+8.1%}  {shown}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    doc = {"profile": args.profile, "steps": args.steps, "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
