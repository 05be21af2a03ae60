"""Predicted vs measured step time of the GRPO runner under each plan mode, side by side.

    python benchmarks/plan_modes.py --profile grpo_profile.yaml [--devices 2] [--steps 20]

For each mode (temporal, hybrid, spatial and the planner's own pick, ``auto``) the planner plans
the profiled workflow on ``--devices`` virtual devices; the unchanged ``workflows/grpo.py`` then
runs ``--steps`` GRPO steps under that plan, every run resuming from one shared warm-started
checkpoint (so no run pays the warm start and all start from the same weights). The table gives
the plan, the predicted and measured seconds per step (median after ``--skip`` steps) and the
error; JSON goes to ``benchmarks/results/plan_modes.json``. A mode the planner finds infeasible
on this cluster (spatial needs a device per group) is reported as such, not run.

RLinf's targets for the prediction error: < 2 % temporal, < 5 % spatial.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from m2flow.cli import prepare
from m2flow.config import ConfigError
from m2flow.planning import load_profile, plan_from_profile
from m2flow.session import Session

ROOT = Path(__file__).resolve().parent.parent
GRPO = str(ROOT / "workflows" / "grpo.py")
GiB = 1 << 30


def _run(overrides: list[str], placement) -> Session:
    module, cfg = prepare(GRPO, overrides, [])
    with Session(placement=placement) as session:
        module.main(cfg)
    return session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile from `m2flow profile`")
    ap.add_argument("--devices", type=int, default=2, help="virtual devices (one per core)")
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps measured per mode")
    ap.add_argument("--skip", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--modes", default="temporal,hybrid,spatial,auto")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, round-robin")
    ap.add_argument("--work", default="scratch/plan_modes", help="run directories")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_modes.json"))
    args = ap.parse_args()

    prof = load_profile(args.profile)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    base = work / "warm"
    common = [f"cluster.devices_per_node={args.devices}", "trainer.eval_every=100000"]
    t0 = time.time()
    _run(common + ["trainer.steps=1", "trainer.save_every=1", f"trainer.run_dir={base}"], None)
    print(f"shared warm start: {time.time() - t0:.0f} s")

    plans, rows = {}, []
    for mode in args.modes.split(","):
        try:
            plans[mode] = plan_from_profile(prof, args.devices, 16 * GiB, mode)
        except ConfigError as e:
            rows.append({"mode": mode, "feasible": False, "why": str(e)})
            print(f"{mode}: infeasible: {e}")
    # Round-robin over modes, so slow drift on a shared machine hits every mode alike.
    runs: dict[str, list[float]] = {m: [] for m in plans}
    for rep in range(args.repeats):
        for mode, (_, placement) in plans.items():
            run_dir = work / f"{mode}-{rep}"
            shutil.copytree(base, run_dir, ignore=shutil.ignore_patterns("ray"))
            overrides = common + [
                f"trainer.steps={1 + args.steps}",
                f"trainer.save_every={10**9}",
                f"trainer.run_dir={run_dir}",
                "resume=true",
            ]
            session = _run(overrides, placement)
            runs[mode].append(statistics.median(session.step_times()[args.skip :]))
            print(f"{mode} run {rep}: {runs[mode][-1]:.4f} s/step")
    for mode, (_, placement) in plans.items():
        measured = statistics.median(runs[mode])
        predicted = placement.predicted_step_s
        rows.append(
            {
                "mode": mode,
                "feasible": True,
                "plan": placement.tree,
                "groups": placement.groups,
                "granularity": placement.granularity,
                "predicted_step_s": predicted,
                "measured_step_s": measured,
                "measured_runs_s": runs[mode],
                "error": (measured - predicted) / measured,
            }
        )

    ran = [r for r in rows if r["feasible"] and r["mode"] != "auto"]
    auto = next((r for r in rows if r["mode"] == "auto" and r["feasible"]), None)
    print(f"\n{'mode':<10} {'predicted s':>12} {'measured s':>11} {'error':>8}  plan")
    for r in rows:
        if not r["feasible"]:
            print(f"{r['mode']:<10} {'infeasible':>12}")
            continue
        first = r["plan"].splitlines()[0]
        print(
            f"{r['mode']:<10} {r['predicted_step_s']:>12.4f} {r['measured_step_s']:>11.4f} "
            f"{r['error']:>+8.1%}  {first}"
        )
    summary = {"devices": args.devices, "steps": args.steps, "rows": rows}
    if ran and auto is not None:
        fastest = min(ran, key=lambda r: r["measured_step_s"])
        summary["planner_pick"] = auto["plan"].splitlines()[0]
        summary["fastest_measured"] = fastest["mode"]
        summary["pick_vs_fastest"] = auto["measured_step_s"] / fastest["measured_step_s"]
        print(
            f"\nplanner's pick measured {auto['measured_step_s']:.4f} s/step; fastest "
            f"measured mode {fastest['mode']} {fastest['measured_step_s']:.4f} s/step "
            f"(ratio {summary['pick_vs_fastest']:.3f})"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
